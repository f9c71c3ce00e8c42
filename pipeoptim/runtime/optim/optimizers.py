"""Optimizers a whole stage can use that torch.optim does not ship as one class.

Why: ``torch.optim.Muon`` only takes 2-D parameters, but a stage also holds biases, norms
and embeddings. The standard practice (Keller Jordan's Muon, Moonshot's Moonlight) runs Muon
on the 2-D weight matrices and AdamW on the rest; :class:`MuonWithAdamW` is that pair as one
``torch.optim.Optimizer``, so checkpoints, LR schedulers, loss scaling and step hooks see a
single optimizer, while each part's update stays torch's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import AdamW, Muon, Optimizer

__all__ = ["MuonWithAdamW"]

_OWN_KEYS = ("params", "use_muon")


class MuonWithAdamW(Optimizer):
    """Muon on 2-D weight matrices, AdamW on every other parameter, as one optimizer.

    One learning rate serves both parts by default: with ``adjust_lr_fn="match_rms_adamw"``
    Muon scales its orthogonalised update by ``0.2·sqrt(max(A, B))`` so its RMS matches
    AdamW's, and the lr (and weight decay) tuned for AdamW carry over (Moonlight, "Muon is
    Scalable for LLM Training"); so ``lr`` is an AdamW-sized rate (~1e-3). For Keller Jordan's
    setting pass ``adjust_lr_fn="original"`` with ``lr≈0.02`` and ``adamw_lr≈3e-4``.

    ``params`` is a list of tensors (split by ``ndim == 2``) or of groups; a group may set
    ``use_muon`` (as Keller Jordan's ``MuonWithAuxAdam``) and per-group options, which go to
    the part it lands in. A 2-D tensor that is not a hidden matrix (an embedding, an output
    head) goes to AdamW only when its group says ``use_muon=False``. A group that sets
    ``use_muon`` is kept even with no parameters (a replica's share under ZeRO may be empty).

    ``param_groups`` is the Muon part's groups followed by the AdamW part's, the very dicts of
    the inner optimizers, so a scheduler writing ``group["lr"]`` drives both; ``state`` holds
    the inner optimizers' per-parameter state dicts (the same objects, refreshed after each
    step and load).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        *,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        adamw_lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        self.muon: Muon | None = None
        self.adamw: AdamW | None = None
        self._muon_options: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": int(ns_steps),
            "adjust_lr_fn": adjust_lr_fn,
        }
        self._adamw_options: dict[str, Any] = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        }
        defaults = {"muon": dict(self._muon_options), "adamw": dict(self._adamw_options)}
        # Optimizer.__init__ hands each group to add_param_group, which routes it.
        super().__init__(cast(Any, params), defaults)

    # -- the parts -------------------------------------------------------------------------
    def parts(self) -> list[Optimizer]:
        """The inner optimizers in ``param_groups`` order (Muon first), those that exist."""
        return [o for o in (self.muon, self.adamw) if o is not None]

    def _refresh(self) -> None:
        # Inner load_state_dict replaces its group dicts and state: re-point at them.
        self.param_groups = [g for o in self.parts() for g in o.param_groups]
        self.state.clear()
        for o in self.parts():
            self.state.update(o.state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split the group into its Muon part (2-D, or ``use_muon=True``) and its AdamW part."""
        raw = param_group["params"]
        ps = [raw] if isinstance(raw, Tensor) else list(raw)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in ps}) != len(ps) or any(id(p) in seen for p in ps):
            raise ValueError("some parameters appear in more than one parameter group")
        use = param_group.get("use_muon")
        extra = {k: v for k, v in param_group.items() if k not in _OWN_KEYS}
        if use is None:
            mats = [p for p in ps if p.ndim == 2]
            rest = [p for p in ps if p.ndim != 2]
        else:
            mats, rest = (ps, []) if use else ([], ps)
        # A group that names its part is kept even empty: ZeRO hands a replica one local
        # group per global group, some of them empty, and pairs them one to one.
        if mats or (use is not None and use):
            group = {"params": mats, **extra}
            if self.muon is None:
                self.muon = Muon([group], **self._muon_options)
            else:
                self.muon.add_param_group(group)
        if rest or (use is not None and not use):
            group = {"params": rest, **extra}
            if self.adamw is None:
                self.adamw = AdamW([group], **self._adamw_options)
            else:
                self.adamw.add_param_group(group)
        self._refresh()

    # -- the update ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of both parts (the closure, if any, is evaluated once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.parts():
            o.step()
        self._refresh()  # state entries are created on a parameter's first step
        return loss

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A torch.optim state dict over all groups (Muon's first; parameter indices run on
        across the parts) with ``muon_groups``: how many of the groups are Muon's."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o in self.parts():
            sd = o.state_dict()
            state.update({offset + int(k): v for k, v in sd["state"].items()})
            groups += [
                {**g, "params": [offset + int(i) for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += sum(len(g["params"]) for g in o.param_groups)
        n_muon = 0 if self.muon is None else len(self.muon.param_groups)
        out: dict[str, Any] = {"state": state, "param_groups": groups, "muon_groups": n_muon}
        for post in self._optimizer_state_dict_post_hooks.values():
            changed = post(self, out)
            if changed is not None:
                out = changed
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` into each part (torch's own load: checks and casts)."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre(self, state_dict)
            if changed is not None:
                state_dict = changed
        groups = state_dict.get("param_groups")
        n_muon = state_dict.get("muon_groups")
        ours = 0 if self.muon is None else len(self.muon.param_groups)
        if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("not an optimizer state dict (no param_groups and state)")
        if n_muon != ours or len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} parameter groups of which {n_muon} are "
                f"Muon's; this MuonWithAdamW has {len(self.param_groups)} with {ours} Muon's"
            )
        state: dict[Any, Any] = state_dict["state"]
        start = 0
        for o in self.parts():
            part = groups[start : start + len(o.param_groups)]
            ids = {i for g in part for i in g["params"]}
            o.load_state_dict(
                {"state": {k: v for k, v in state.items() if k in ids}, "param_groups": part}
            )
            start += len(o.param_groups)
        self._refresh()
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer pickles only defaults, state and groups; the parts are the optimizer.
        return {
            **super().__getstate__(),
            **{
                k: v
                for k, v in self.__dict__.items()
                if k in ("muon", "adamw", "_muon_options", "_adamw_options")
            },
        }
