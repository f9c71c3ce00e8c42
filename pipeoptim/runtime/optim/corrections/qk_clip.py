"""``qk-clip``: QK-Clip, the attention-logit control of MuonClip (Kimi K2, arXiv 2507.20534).

After each optimizer update, per attention head h, with ``S_h`` the largest pre-softmax logit
``q_i·k_j·scale`` of that head over the training forwards since the previous update: where
``S_h > τ``, ``γ_h = τ / S_h`` and head h's query rows and key rows (weights and biases) are
each multiplied by ``√γ_h``, so that head's logits scale by exactly γ_h; heads at or under τ
are untouched. K2 uses τ = 100 (:data:`QK_CLIP_THRESHOLD`). Where several query heads share
one key head (grouped-query attention) only the query side is scaled, by γ_h, as K2 leaves
its shared rotary key alone.

Under asynchronous delay the forwards since the last update are the latest mini-batch's, run
on the freshest weights (or their prediction), not those of the delayed mini-batch the step
applies: they measure the freshest weights, which the clip then rescales. An update with no
forward since the previous one (a drain's last updates) measured nothing new and clips
nothing.

Why a delay correction: under asynchronous delay the first attention unit's max logit grows
from about 21 to 110 and its attention entropy collapses (``examples/convergence/
attention.py``). The clip acts after the step, on the live weights: a predicting method's
next forward reads ``Ŵ = clip(W) − Σ lr·Δ`` (the predictor's Δ is the optimizer's own update,
recorded inside the step), and the backward of a mini-batch in flight reads the clipped live
weights as it reads any update of them. The optimizer's state is left as it is (as in K2).

The stage's attention units expose their logits (``runtime/model/attention_logits.py``); the
correction starts their recording and refuses a stage holding attention that exposes none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.model.attention_logits import AttentionLogits, find_attention
from pipeoptim.runtime.optim.corrections.protocol import StageContext

__all__ = ["QK_CLIP_THRESHOLD", "QKClip", "clip_factors", "refuse_clip_without_attention"]

QK_CLIP_THRESHOLD = 100.0
"""τ of QK-Clip, Kimi K2's. For another, register a factory of your own before the
Pipeline is built (in every process: at the top of the model's module under ``dist``):
``CORRECTIONS["qk-clip"] = lambda context, optimizer: QKClip(context, optimizer, 30.0)``."""


def clip_factors(peaks: Tensor, threshold: float) -> Tensor:
    """``γ_h = min(1, τ / S_h)``: ``τ / S_h`` where ``S_h > τ``, else 1."""
    return torch.where(peaks > threshold, threshold / peaks, torch.ones_like(peaks))


def refuse_clip_without_attention(
    method: str, correction: str | None, base: str | None, units: Sequence[nn.Module]
) -> None:
    """Refuse qk-clip on a model none of whose units holds attention: it could never act,
    and the run would be its base method's under another name. Checked over the whole
    model (a stage without attention beside stages with it is fine: nothing to clip there)."""
    if correction != "qk-clip":
        return
    if any(found for unit in units for found in find_attention(unit)):
        return
    plain = base or "a method without +qk-clip"
    raise RuntimeConfigError(
        f"{method} clips the attention logits (qk-clip), which acts only on attention "
        f"units, but none of the model's {len(units)} units holds one (an nn."
        f"MultiheadAttention, a module named like *Attention* or *Attn*, or one with an "
        f"attention_logits), so it would train as {base or 'its base method'}; train with "
        f"{plain} instead, or give the model's attention an attention_logits (docs/choosing-a-"
        f"method.md, 'QK-Clip')"
    )


class QKClip:
    """QK-Clip on the attention units of one stage, after every step.

    ``replica_max`` is set under data parallelism (``comm.replicas.ReplicaMax``): each
    replica's forwards saw its own share of the batch, so S_h is the max over the replicas,
    taken in one all-reduce per update, and every replica clips alike."""

    def __init__(
        self,
        context: StageContext,
        optimizer: Optimizer,
        threshold: float = QK_CLIP_THRESHOLD,
    ) -> None:
        if not threshold > 0:
            raise RuntimeConfigError(
                f"QK-Clip's threshold τ must be positive (got {threshold}); Kimi K2 uses "
                f"{QK_CLIP_THRESHOLD:g}"
            )
        self.threshold = float(threshold)
        self.stage = context.index
        self.method = context.method
        module = context.module
        if module is None:
            raise RuntimeConfigError(
                f"stage {context.index}: {context.method} clips attention logits (qk-clip), "
                f"which needs the stage's modules, but its StageContext carries none "
                f"(module=None); build the rule from a Stage, or pass module= to StageContext"
            )
        self.module = module
        exposing, silent = find_attention(module)
        if silent:
            names = ", ".join(f"{n} ({type(m).__name__})" for n, m in silent)
            raise RuntimeConfigError(
                f"stage {context.index}: {context.method} clips each attention head's max "
                f"logit (qk-clip, τ = {self.threshold:g}), but {names} exposes no logits; "
                f"give the module an attention_logits (pipeoptim.runtime.model."
                f"attention_logits.AttentionLogits naming its query and key rows) and call "
                f"attention_logits.record(q, k, scale) in its forward (docs/"
                f"choosing-a-method.md, 'QK-Clip'), or train without +qk-clip"
            )
        self.units: list[tuple[str, nn.Module, AttentionLogits]] = exposing
        """(name in the stage, module, recorder) of each attention unit; none: nothing to
        clip (an MLP or an embedding stage)."""
        for _, unit, logits in exposing:
            logits.start(unit)
        self.replica_max: Callable[[Tensor], None] | None = None
        """Takes the max of a tensor over the stage's replicas in place (data parallelism)."""
        self.latest: list[Tensor | None] = [None] * len(exposing)
        """Each unit's S per head at the last update (float32, on the stage's device)."""
        self.clipped: Tensor | None = None
        """Heads clipped so far, summed over the updates (a device tensor: no host sync)."""

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        return None

    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        measured = [(i, self._peak(i)) for i in range(len(self.units))]
        found = [(i, peak) for i, peak in measured if peak is not None]
        if not found:  # no forward since the last update (a drain's last updates)
            return
        peaks = [peak for _, peak in found]
        if self.replica_max is not None:
            flat = torch.cat(peaks)
            self.replica_max(flat)
            peaks = list(torch.split(flat, [p.numel() for p in peaks]))
        count: Tensor | None = None
        for (i, _), peak in zip(found, peaks, strict=True):
            _, module, logits = self.units[i]
            self.latest[i] = peak
            logits.clip_(module, clip_factors(peak, self.threshold))
            over = (peak > self.threshold).sum()
            count = over if count is None else count + over
        assert count is not None
        self.clipped = count if self.clipped is None else self.clipped + count

    def _peak(self, i: int) -> Tensor | None:
        """Unit i's S since the last update; None where no forward ran since (the drain's
        last updates follow backwards only). A unit that never recorded is refused."""
        name, module, logits = self.units[i]
        peak = logits.take()
        if peak is None and logits.records == 0:
            raise RuntimeConfigError(
                f"stage {self.stage}: {self.method} clips {name} ({type(module).__name__}), "
                f"which exposes attention logits but recorded none in the training forwards "
                f"before this update; its forward must call attention_logits.record(q, k, "
                f"scale) where attention_logits.active(self.training) (docs/"
                f"choosing-a-method.md, 'QK-Clip')"
            )
        return peak

    @property
    def clips(self) -> int:
        """Heads clipped so far (reads the count back to the host)."""
        return 0 if self.clipped is None else int(self.clipped)

    def state_dict(self) -> dict[str, Any]:
        """τ, the heads clipped so far, each unit's last S, and what its recorder holds now
        (None between segments, where checkpoints are written)."""
        return {
            "threshold": self.threshold,
            "clipped": self.clips,
            "latest": [None if t is None else t.detach().cpu().clone() for t in self.latest],
            "pending": [
                None if logits.peak is None else logits.peak.detach().cpu().clone()
                for _, _, logits in self.units
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the threshold stays this run's (a hyper-parameter)."""
        latest, pending = list(state.get("latest", [])), list(state.get("pending", []))
        if len(latest) != len(self.units) or len(pending) != len(self.units):
            raise RuntimeConfigError(
                f"stage {self.stage}: the saved QK-Clip state holds {len(latest)} attention "
                f"units, this stage has {len(self.units)}; load a state saved from the same "
                f"layers"
            )
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        self.clipped = torch.tensor(int(state.get("clipped", 0)), device=device)
        self.latest = [None if t is None else t.to(device) for t in latest]
        for (_, _, logits), saved in zip(self.units, pending, strict=True):
            logits.peak = None if saved is None else saved.to(device)
