"""A stage's optimizer state sharded across its D data-parallel replicas (ZeRO stage 1).

Why ``torch.distributed.optim.ZeroRedundancyOptimizer`` and how it meets the stage's build:
ZeRO-1 is exactly what it does (each replica builds a local optimizer over about 1/D of the
parameters, steps it, and every updated parameter is broadcast from its owner), with its own
checkpoint consolidation, so the collective of the update is torch's, not ours. It is built
from an optimizer *class* and keyword defaults, while a stage's optimizer comes from a spec or
a user factory returning an instance; so the stage first builds the user's optimizer as
always (checked by ``update.build_optimizer``; torch.optim creates state lazily, so it holds
nothing yet) and :func:`shard_optimizer` builds ZeRO from that instance's class, parameter
groups (every hyper-parameter of every group) and defaults. Each local group is then the
user's group restricted to this replica's parameters, so the update of every parameter is the
same computation as unsharded, which is exact for optimizers whose step updates each
parameter from its own gradient and state: :data:`SHARDABLE` lists those; any other class
(including a subclass, whose step may couple parameters) is refused with the fix.

Gradients are still all-reduced whole before the step (``replicas.GradientAverager``), so
clipping reads the same global norm on every replica and equals the unsharded run's.

How Ŵ is formed (:class:`ShardedPredictor`): the method's predictor reads the *local*
optimizer, so each replica predicts the parameters it owns (the same arithmetic on the same
state as unsharded, so the same bits), and the predicted shards are gathered into every
replica's prediction buffer with one ``all_gather_into_tensor`` per predicted forward (each
replica sends its ~1/D of the stage's parameter bytes, padded to the largest shard). Nothing
is gathered where nothing moves (s = 0 or a zero rate): every replica then copies W. The
alternative, each owner computing Δ at its update and gathering Δ with the weights, would
hold a full weight-sized Δ on every replica, as much memory as Adam's saved shard at D = 2.
Rules that keep a Δ between updates (Muon, basis rotation, XPipe where it predicts a
second distance before the next update) keep only their shard.

Checkpoints stay in today's format: :func:`full_state_dict` consolidates the local states
(ZeRO's ``consolidate_state_dict``, to every replica) into the state dict the unsharded
optimizer would return, and :func:`load_full_state` takes such a dict (saved sharded or not,
at any D) and keeps this replica's part, so a run resumes onto another D, sharded or not.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import TypeIs

from pipeoptim.errors import StageError
from pipeoptim.runtime.comm.replicas import collective
from pipeoptim.runtime.optim.families import TORCH_FAMILIES
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW
from pipeoptim.runtime.optim.predict import Deltas, WeightPredictor, check_distance
from pipeoptim.runtime.optim.update_persistence import UpdatePersistence

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

_ZERO_PACKAGE = "torch.distributed.optim"
"""The public package that exports ZeRO (loaded before any of its modules is)."""

__all__ = [
    "SHARDABLE",
    "ShardedPredictor",
    "full_state_dict",
    "is_sharded",
    "load_full_state",
    "local_optimizer",
    "optimizer_class_name",
    "shard_optimizer",
    "unsharded_twin",
]

_TORCH_ELEMENTWISE = (
    "SGD",
    "Adam",
    "AdamW",
    "NAdam",
    "RAdam",
    "Adamax",
    "Adagrad",
    "Adadelta",
    "Adafactor",
    "RMSprop",
    "Rprop",
    "ASGD",
    "Muon",
)
SHARDABLE: frozenset[type[Optimizer]] = frozenset(
    {
        *(getattr(torch.optim, n) for n in _TORCH_ELEMENTWISE if hasattr(torch.optim, n)),
        *(
            f.optimizer_class
            for f in TORCH_FAMILIES.values()
            if f.optimizer_class is not None and f.steps_each_parameter_alone
        ),
    }
)
"""Optimizer classes (exact types) whose step updates each parameter from its own gradient
and state only, so a replica may own whole parameters and step them alone."""


def is_sharded(optimizer: Optimizer | None) -> TypeIs[ZeroRedundancyOptimizer]:
    """Whether ``optimizer`` is a stage's sharded (ZeRO) optimizer. ZeRO's module is read
    only where it is loaded (none of its instances exists otherwise), so a rank that does
    not shard starts without importing ``torch.distributed.optim``."""
    package = sys.modules.get(_ZERO_PACKAGE)
    return package is not None and isinstance(optimizer, package.ZeroRedundancyOptimizer)


def _zero_class() -> type[ZeroRedundancyOptimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that holds this process's state: ZeRO's local one, else ``optimizer``."""
    if is_sharded(optimizer):
        return cast(Optimizer, optimizer.optim)
    return optimizer


def optimizer_class_name(optimizer: Optimizer) -> str:
    """The user's optimizer class, sharded or not (what checkpoints and plans record)."""
    return type(local_optimizer(optimizer)).__name__


def _constructor(opt: Optimizer) -> tuple[Callable[..., Optimizer], dict[str, Any]]:
    """How ZeRO builds the local optimizer from its groups: the class with its defaults, or
    for :class:`MuonWithAdamW` (whose constructor takes no per-part defaults) the composite
    with each group sent to the part it came from (even an empty local group: ZeRO pairs the
    local groups with the global ones one to one)."""
    if isinstance(opt, MuonWithAdamW):
        n_muon = 0 if opt.muon is None else len(opt.muon.param_groups)

        def build(groups: list[dict[str, Any]], **_: Any) -> Optimizer:
            return MuonWithAdamW([{**g, "use_muon": i < n_muon} for i, g in enumerate(groups)])

        return build, {}
    return type(opt), _accepted(type(opt), opt.defaults)


def _accepted(cls: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults the class's constructor takes as keywords (AdamW's defaults hold
    ``decoupled_weight_decay``, which its constructor fixes): the others reach the local
    optimizer in its groups, which carry every hyper-parameter."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


def _fix(stage: int) -> str:
    return (
        f"build stage {stage}'s optimizer as one of torch.optim's per-parameter optimizers "
        f"({', '.join(sorted(c.__name__ for c in SHARDABLE))}), or leave shard_optimizer "
        f"off (pipeoptim train: drop --shard-optimizer)"
    )


def shard_optimizer(opt: Optimizer, group: dist.ProcessGroup, *, stage: int) -> Optimizer:
    """``opt`` (just built by the stage's spec or factory, no state yet) as a
    ZeroRedundancyOptimizer over ``group``: the same class, groups and hyper-parameters,
    each replica owning about 1/D of the parameters (whole tensors, ZeRO's greedy split by
    size). Refuses what cannot be sharded exactly, naming the class and the fix."""
    cls = type(opt)
    if cls not in SHARDABLE:
        raise StageError(
            f"stage {stage}: shard_optimizer cannot shard {cls.__module__}.{cls.__name__}: "
            f"each replica steps only the parameters it owns, which equals the unsharded "
            f"step only for an optimizer known to update every parameter from its own "
            f"gradient and state (a subclass or another class may couple them or take other "
            f"constructor arguments); {_fix(stage)}"
        )
    if any(_stepped(state) for state in opt.state.values()):
        raise StageError(
            f"stage {stage}: the optimizer factory returned {cls.__name__} already holding "
            f"state, which shard_optimizer cannot split; return a fresh optimizer (load "
            f"state through Pipeline.load_state_dict or a checkpoint), or leave "
            f"shard_optimizer off"
        )
    build, defaults = _constructor(opt)
    groups = [{**g, "params": list(g["params"])} for g in opt.param_groups]
    try:
        zero = _zero_class()(
            groups, optimizer_class=cast(Any, build), process_group=group, **defaults
        )
    except (TypeError, ValueError, RuntimeError) as err:
        raise StageError(
            f"stage {stage}: shard_optimizer cannot build {cls.__name__} over this replica's "
            f"share of the parameters ({type(err).__name__}: {err}); {_fix(stage)}"
        ) from None
    local = cast(Optimizer, zero.optim)
    same = type(local) is cls and len(local.param_groups) == len(opt.param_groups)
    for mine, theirs in zip(local.param_groups, opt.param_groups, strict=False):
        keys = (set(mine) | set(theirs)) - {"params"}
        same = same and all(_equal(mine.get(k), theirs.get(k)) for k in keys)
    if not same:
        raise StageError(
            f"stage {stage}: sharding {cls.__name__} changed its parameter groups' "
            f"hyper-parameters (its constructor does not rebuild them from its defaults); "
            f"{_fix(stage)}"
        )
    return zero


def _stepped(state: dict[str, Any]) -> bool:
    """Whether a parameter's state was written by a step: Adagrad's constructor creates its
    state at step 0 (ZeRO's local Adagrad creates its own), every other entry comes from a
    step (SGD's momentum buffer has no step count)."""
    if not state:
        return False
    step = state.get("step")
    return step is None or float(step) != 0.0


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    return bool(a == b)


def unsharded_twin(optimizer: Optimizer) -> Optimizer:
    """A fresh unsharded optimizer over the same groups (no state): what a checkpoint of
    unknown class is tried on before anything is loaded into the sharded one."""
    if not is_sharded(optimizer):
        return optimizer
    local = cast(Optimizer, optimizer.optim)
    if isinstance(local, MuonWithAdamW):
        n_muon = 0 if local.muon is None else len(local.muon.param_groups)
        return MuonWithAdamW(
            [
                {**g, "params": list(g["params"]), "use_muon": i < n_muon}
                for i, g in enumerate(optimizer.param_groups)
            ]
        )
    groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
    return type(local)(groups, **_accepted(type(local), local.defaults))


def full_state_dict(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state dict as the unsharded optimizer returns it; a sharded one is
    consolidated first, on every replica (a collective over the stage's replicas: all of
    them call it, in the same order). Tensors of a consolidated state are CPU copies."""
    if not is_sharded(optimizer):
        return optimizer.state_dict()
    zero = optimizer
    state: dict[str, Any] = {}
    for target in range(zero.world_size):  # ZeRO's own gather, once to each replica
        with collective(zero.process_group, "gathering the sharded optimizer state"):
            zero.consolidate_state_dict(to=target)
        if zero.rank == target:  # the next call empties what this one gathered
            try:
                state = zero.state_dict()
            finally:
                cast(Any, zero)._all_state_dicts = []  # not kept after the checkpoint
    local = zero.optim
    if isinstance(local, MuonWithAdamW):
        state["muon_groups"] = 0 if local.muon is None else len(local.muon.param_groups)
    return state


def load_full_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load an unsharded optimizer's state dict (a checkpoint of any D, sharded or not):
    a sharded optimizer keeps this replica's part. ``state`` may be changed (pass a copy)."""
    if not is_sharded(optimizer):
        optimizer.load_state_dict(state)
        return
    zero = optimizer
    zero.load_state_dict({k: v for k, v in state.items() if k != "muon_groups"})
    # ZeRO's Optimizer.load_state_dict also keeps a copy of this replica's entries in the
    # wrapper's own state, which nothing reads: drop it, or the shard would be held twice.
    zero.state.clear()
    local = zero.optim
    if isinstance(local, MuonWithAdamW):
        # ZeRO wrote the composite's state dict; the parts step on their own dicts
        for part in local.parts():
            for g in part.param_groups:
                for p in g["params"]:
                    if p in local.state:
                        part.state[p] = local.state[p]
        local._refresh()
    # ZeRO set the local state directly, so the local optimizer's own load hooks (a
    # predictor dropping a Δ kept from the state before) are run here
    parts = local.parts() if isinstance(local, MuonWithAdamW) else []
    for opt in (local, *parts):
        for hook in list(opt._optimizer_load_state_dict_post_hooks.values()):
            hook(opt)


class ShardedPredictor(WeightPredictor):
    """The method's predictor over this replica's shard, gathered into the whole Ŵ.

    ``inner`` is the predictor of the rule for the *local* optimizer (its hooks record
    around the local step); :meth:`predict_into` writes the owned parameters' Ŵ and gathers
    the other replicas' into ``dest`` with one ``all_gather_into_tensor``. The checkpoint
    form (displacements by the stage's flat parameter index) is the unsharded predictor's.
    """

    def __init__(self, inner: WeightPredictor, zero: ZeroRedundancyOptimizer) -> None:
        super().__init__(zero, auto_hooks=False)
        self.inner = inner
        # the rule's own name, so checkpoints and their checks read the same as unsharded
        setattr(self, "name", inner.name)  # noqa: B010 - shadows the ClassVar per instance
        self.zero = zero
        self.group: dist.ProcessGroup = zero.process_group
        self.replica = zero.rank
        position = {p: i for i, p in enumerate(self._params())}
        partition: list[list[dict[str, Any]]] = cast(Any, zero)._partition_parameters()
        self._owned: list[list[int]] = [
            [position[p] for g in groups for p in g["params"]] for groups in partition
        ]
        """Flat parameter indices each replica owns, in its local optimizer's order."""
        local = [p for g in inner.optimizer.param_groups for p in g["params"]]
        if [position[p] for p in local] != self._owned[self.replica]:
            raise StageError(
                "the sharded optimizer's local parameters are not its partition's; "
                "build the predictor with shard_predictor(rule, zero)"
            )
        self._sources = [dist.get_global_rank(self.group, r) for r in range(len(partition))]
        """The process-group rank of each replica (broadcasts name global ranks)."""
        if inner.persistence is not None:
            # φ over every parameter, as unsharded: measured around the whole (ZeRO) step
            inner.persistence.close()
            inner.persistence = UpdatePersistence(zero)
            for part in getattr(inner, "parts", []):
                part.persistence = inner.persistence
        self.persistence = inner.persistence

    # -- prediction ------------------------------------------------------------------------
    def predict_into(
        self, dest: list[Tensor], s: int, lrs: Sequence[Sequence[float]] | None = None
    ) -> None:
        s = check_distance(s)
        self._check_dest(dest)
        etas = self._etas(s, lrs)
        params = self._params()
        with torch.no_grad():
            if s == 0 or not any(etas):  # W everywhere: nothing to gather
                pairs = [
                    (d, p)
                    for d, p in zip(dest, params, strict=True)
                    if d.data_ptr() != p.data_ptr()
                ]
                if pairs:
                    torch._foreach_copy_([d for d, _ in pairs], [p.detach() for _, p in pairs])
                return
            # the hyper-parameters a scheduler or a correction wrote since the last step
            sync = cast(Any, _zero_class())._sync_param_groups
            sync(self.zero.param_groups, self.inner.optimizer.param_groups)
            mine = self._owned[self.replica]
            self.inner.predict_into([dest[i] for i in mine], s, lrs)
            self.kept_computations = self.inner.kept_computations
            # every predicted parameter from its owner, straight into the buffer (ZeRO's own
            # weight sync, parameter by parameter): no gather buffer, so no transient copy
            handles = []
            strided = {i: dest[i].contiguous() for i in range(len(dest))}
            strided = {i: t for i, t in strided.items() if t.data_ptr() != dest[i].data_ptr()}
            with collective(self.group, "gathering the predicted weights"):
                for r, own in enumerate(self._owned):
                    for i in own:
                        target = strided.get(i, dest[i])
                        handles.append(
                            dist.broadcast(
                                target, src=self._sources[r], group=self.group, async_op=True
                            )
                        )
                for handle in handles:
                    if handle is not None:
                        handle.wait()
            for i, t in strided.items():  # a non-contiguous destination, through a copy
                dest[i].copy_(t)

    def delta(self) -> Deltas:
        """Δ of every parameter, gathered from the owners (a collective over the replicas)."""
        mine = [d for row in self.inner.delta() for d in row]
        owned = dict(zip(self._owned[self.replica], mine, strict=True))
        shared = {i: None if d is None else d.cpu() for i, d in owned.items()}
        every: list[Any] = [None] * len(self._owned)
        with collective(self.group, "gathering the prediction's Δ"):
            dist.all_gather_object(every, shared, group=self.group)
        flat: dict[int, Tensor | None] = {i: d for part in every for i, d in part.items()}
        params = self._params()
        out: Deltas = []
        offset = 0
        for g in self.optimizer.param_groups:
            row: list[Tensor | None] = []
            for j in range(len(g["params"])):
                d = flat[offset + j]
                row.append(None if d is None else d.to(params[offset + j].device))
            out.append(row)
            offset += len(g["params"])
        return out

    # -- the record lives in the inner predictor (hooked on the local optimizer) ------------
    def prepare_deltas(self) -> None:
        """This replica's shard of Δ, kept by the inner predictor (no collective), from the
        hyper-parameters :meth:`predict_into` would read."""
        sync = cast(Any, _zero_class())._sync_param_groups
        sync(self.zero.param_groups, self.inner.optimizer.param_groups)
        self.inner.prepare_deltas()
        self.kept_computations = self.inner.kept_computations

    def before_step(self) -> None:
        self.inner.before_step()

    def after_step(self) -> None:
        self.inner.after_step()

    def close(self) -> None:
        self.inner.close()

    def held_tensors(self) -> list[Tensor]:
        """What this replica's shard of the rule keeps (its share of displacements, Δ)."""
        return self.inner.held_tensors()

    # -- checkpoints -----------------------------------------------------------------------
    def _displacements(self) -> dict[int, Tensor]:
        """Every replica's recorded displacements by the stage's flat index (a collective:
        every replica calls it, through :meth:`state_dict`)."""
        mine = self._owned[self.replica]
        local = {mine[i]: t.detach().cpu() for i, t in self.inner._displacements().items()}
        every: list[Any] = [None] * len(self._owned)
        with collective(self.group, "gathering the prediction's displacements"):
            dist.all_gather_object(every, local, group=self.group)
        return dict(sorted((i, t) for part in every for i, t in part.items()))

    def _load_displacements(self, disp: dict[int, Tensor]) -> None:
        local = {j: disp[i] for j, i in enumerate(self._owned[self.replica]) if i in disp}
        self.inner._load_displacements(local)


def shard_predictor(inner: WeightPredictor, optimizer: Optimizer) -> WeightPredictor:
    """``inner`` (built on the local optimizer) as the stage's predictor: wrapped to gather
    the shards where ``optimizer`` is sharded, else as it is."""
    if not is_sharded(optimizer):
        return inner
    return ShardedPredictor(inner, optimizer)
