"""What PipeDream's delays do to the language model's attention: gpt-deep at 8 stages, the
first 700 updates trained synchronously, with every stage's delay, and with every stage's
delay on a copy of the model whose attention normalises q and k (QK-LayerNorm).

    python examples/convergence/attention.py              # 3 runs of 700 updates, one
                                                          # process each: ~35 s on a core
    python examples/convergence/attention.py --report-only

Every 100 updates each run records the test loss (first 1,024 test samples) and, per
attention unit, the mean entropy of its attention rows (positions 8 and on, 64 test
samples) and its largest |q·k|/√d. The recipe is the study's (AdamW 2e-3, weight decay
0.01, 10 % warm-up of the 2,000-update schedule, cosine to 0.1x, clipping 1.0 per stage, a
drain every 250), trained by :class:`pipeoptim.study.delays.DelayEmulator`. Results go to
``results/gpt-deep/attention.jsonl`` and ``results/gpt-deep/attention.md``.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from ablate import script_main  # the script beside this one
from torch import Tensor, nn

from pipeoptim.workloads.gpt import AttentionHalf

RESULTS = Path(__file__).resolve().parent / "results" / "gpt-deep"
STAGES, SCHEDULE, STEPS, EVERY, BATCH, LR = 8, 2000, 700, 100, 32, 2e-3
RUNS = {
    # name: (what, delayed, QK-LayerNorm)
    "sync": ("synchronous", False, False),
    "delayed": ("every stage's own delay (pipedream)", True, False),
    "delayed+qknorm": ("every stage's own delay, QK-LayerNorm", True, True),
}


class QKNormAttention(AttentionHalf):
    """An :class:`AttentionHalf` whose per-head q and k pass through a LayerNorm each, which
    bounds |q·k|/√d by the norms' gains (Dehghani et al. 2023)."""

    def __init__(self, half: AttentionHalf) -> None:
        nn.Module.__init__(self)
        self.heads, self.dropout = half.heads, half.dropout
        self.norm1, self.qkv, self.proj, self.drop = half.norm1, half.qkv, half.proj, half.drop
        head_dim = half.qkv.in_features // half.heads
        self.q_norm, self.k_norm = nn.LayerNorm(head_dim), nn.LayerNorm(head_dim)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.project(x)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return out


def _scores(unit: AttentionHalf, x: Tensor) -> Tensor:
    """The unit's causal attention logits q·k/√d, (B, heads, T, T), −inf above the diagonal."""
    if isinstance(unit, QKNormAttention):
        q, k, _ = unit.project(x)
    else:
        b, t, d = x.shape
        q, k, _ = unit.qkv(unit.norm1(x)).split(d, dim=2)
        q, k = (z.view(b, t, unit.heads, d // unit.heads).transpose(1, 2) for z in (q, k))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t = s.shape[-1]
    return s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)


def probe(units: list[nn.Module], x: Tensor) -> list[tuple[float, float]]:
    """(mean row entropy at positions 8 and on, largest |logit|) per attention unit."""
    out = []
    with torch.no_grad():
        h = x
        for unit in units:
            if isinstance(unit, AttentionHalf):
                s = _scores(unit, h)
                p = s.softmax(-1)
                entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)[..., 8:].mean()
                largest = s.masked_fill(s.isinf(), 0.0).abs().amax()
                out.append((float(entropy), float(largest)))
            h = unit(h)
    return out


def run(name: str) -> dict[str, object]:
    from torch.optim.lr_scheduler import LambdaLR

    from pipeoptim.plan.plan import even_boundaries
    from pipeoptim.runtime.optim.lr import WarmupCosine
    from pipeoptim.study.delays import DelayEmulator
    from pipeoptim.workloads.data import DatasetLoader
    from pipeoptim.workloads.gpt import gpt_deep, lm_loss, python_corpus_deep

    what, delayed, qk_norm = RUNS[name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    units = gpt_deep()
    if qk_norm:
        units = [QKNormAttention(u) if isinstance(u, AttentionHalf) else u for u in units]
    data = python_corpus_deep()
    emulator = DelayEmulator(
        units,
        even_boundaries(len(units), STAGES),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01),
        loss_fn=lm_loss,
        delay=lambda param, stage, step: STAGES - 1 - stage if delayed else 0,
        max_delay=STAGES - 1,
        scheduler=functools.partial(LambdaLR, lr_lambda=WarmupCosine(200, SCHEDULE, 0.1)),
        grad_clip=1.0,
        drain_every=250,
    )
    train = DatasetLoader(data.train_x, data.train_y, BATCH, seed=0)
    test_x, test_y = data.test_x[:1024], data.test_y[:1024]
    start, points = time.perf_counter(), []

    def record() -> None:
        emulator.model.eval()
        with torch.no_grad():
            test = float(lm_loss(emulator.model(test_x), test_y))
        heads = probe(units, test_x[:64])
        points.append({"step": emulator.steps, "test": test, "heads": heads})
        emulator.model.train()

    record()
    batches = iter(train)
    while emulator.steps < STEPS:
        try:
            x, y = next(batches)
        except StopIteration:  # a new epoch
            batches = iter(train)
            continue
        emulator.step(x, y)
        if emulator.steps % EVERY == 0:
            record()
    return {"name": name, "what": what, "points": points, "seconds": time.perf_counter() - start}


def _uniform_entropy() -> float:
    """The probe's entropy of uniform causal attention: mean of ln(i + 1) over positions 8+."""
    from pipeoptim.workloads.gpt import DEEP_CONTEXT as context

    return sum(math.log(i + 1) for i in range(8, context)) / (context - 8)


def report(records: list[dict[str, object]]) -> str:
    by = {str(r["name"]): r for r in records}
    lines = [
        "First attention unit (stage 0, τ = 7 when delayed): test loss, mean attention "
        f"entropy (nats; uniform attention: {_uniform_entropy():.2f}) and largest |q·k|/√d, every "
        f"{EVERY} updates.",
        "",
        "| update | " + " | ".join(RUNS[n][0] for n in RUNS if n in by) + " |",
        "|---|" + "---|" * sum(n in by for n in RUNS),
    ]
    runs = [by[n]["points"] for n in RUNS if n in by]
    for i in range(max((len(p) for p in runs), default=0)):  # type: ignore[arg-type]
        cells = []
        step = None
        for points in runs:
            if i >= len(points):  # type: ignore[arg-type]
                cells.append("")
                continue
            point = points[i]  # type: ignore[index]
            step = point["step"]
            entropy, largest = point["heads"][0]
            cells.append(f"{point['test']:.2f}, H {entropy:.2f}, max {largest:.0f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    script_main(
        __doc__, list(RUNS), run, RESULTS / "attention.jsonl", report, RESULTS / "attention.md"
    )


if __name__ == "__main__":
    main()
