"""A Pipeline's built parts: the plan and its shape, placement, transports, stages, replicas.

Why apart from the front: ``Pipeline.__init__`` checks the user's arguments and then builds
the same things in the same order for every run (local or dist, one replica or D); the fit
loop, the checkpoint folder and the results read these parts and never rebuild them. What
changes during a run lives in :class:`RunState`, shared by those three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoptim.errors import PipeoptimError, RuntimeConfigError
from pipeoptim.plan.methods import Method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.versions import steady_delays
from pipeoptim.runtime.comm.dist import DistTransport
from pipeoptim.runtime.comm.placement import join_group, local_device
from pipeoptim.runtime.comm.replicas import (
    BufferBroadcast,
    GradientAverager,
    ReplicaGroups,
    ReplicaMax,
)
from pipeoptim.runtime.comm.stop_channel import StopChannel
from pipeoptim.runtime.comm.transport import Transport
from pipeoptim.runtime.model.materialize import materialize_units, meta_units
from pipeoptim.runtime.model.ties import (
    TieExchange,
    find_ties,
    refuse_for,
    refuse_mixed_streams,
    untie_copies,
)
from pipeoptim.runtime.optim.builder import reads_delays
from pipeoptim.runtime.optim.corrections.qk_clip import QKClip, refuse_clip_without_attention
from pipeoptim.runtime.optim.global_clip import NormBoard
from pipeoptim.runtime.optim.sharded import optimizer_class_name
from pipeoptim.runtime.optim.update import (
    FAMILY_OF_CLASS,
)
from pipeoptim.runtime.options import PipelineOptions
from pipeoptim.runtime.pipeline_clip import PipelineClip
from pipeoptim.runtime.segments import segment_plan
from pipeoptim.runtime.stage.stage import Stage

__all__ = ["Assembly", "RunState"]


@dataclass
class RunState:
    """What changes as a Pipeline trains: read by the front, the loop and the folder."""

    step: int = 0
    """Mini-batches trained so far (the global step)."""
    last_checkpoint: int | None = None
    """The step of the newest checkpoint written or loaded (None: none yet)."""
    failed: str | None = None
    """Why the Pipeline stopped with passes in flight (None: usable)."""
    busy: bool = False
    """A schedule is running: an error now leaves passes in flight."""
    notes: list[str] = field(default_factory=list)
    """What the run says about itself (a resume's changes...), for the result."""
    resumed_with: dict[str, Any] = field(default_factory=dict)
    """Hyper-parameters a resume changed: name -> [old, new]."""


class Assembly:
    """The parts of one process's share of a pipeline, built in this order: placement (and
    the process group under dist), transports, this process's stages, the replicas' start
    from replica 0's weights."""

    def __init__(
        self,
        units: list[nn.Module],
        plan: Plan,
        method: Method,
        bounds: list[tuple[int, int]],
        options: PipelineOptions,
    ) -> None:
        self.units, self.plan, self.method, self.bounds = units, plan, method, bounds
        # the whole model is known only here: a stage sees its own units
        refuse_clip_without_attention(method.name, method.correction, method.corrects, units)
        self.options = options
        self.shape = plan.shape(1)
        self.seed = options.stage.seed
        self.process_model, self.timeout = options.process_model, options.timeout
        store, device, amp = options.store, options.device, options.stage.amp
        n_stages = self.shape.num_stages
        self.rank_of = segment_plan(method, self.shape).rank_of
        self.last = n_stages - 1
        self.owns_group = False
        self.store = store
        self.replicas = ReplicaGroups.single(self.shape.num_ranks)
        """This process's replica and its process groups (``replicas.py``)."""
        self.device, ranks = self._place(device)
        self.ranks = ranks
        self.transports: dict[int, Transport] = self.process_model.transports(
            self.shape.num_ranks,
            ranks[0],
            self.device,
            self.replicas.global_rank(0),
            self.timeout,
            one_tag=options.one_tag,
            num_stages=n_stages,
            varying_shapes=options.varying_shapes,
        )
        self.chained_probe = not self.process_model.one_process and bool(meta_units(units))
        """No rank holds the whole model (built on the meta device): the dry run goes stage
        by stage, each on its own rank (``FitLoop._probe_chain``)."""
        # Ties are found by identity before anything is materialised (which makes new tensors)
        self.ties = find_ties(units, bounds)
        refuse_for(method, self.ties, amp)
        held = [k for k, r in self.rank_of.items() if r in ranks]
        materialize_units(
            units,
            [u for k in sorted(held) for u in range(*bounds[k])],
            self.device,
            options.init_weights,
            self.seed,
        )
        tied = untie_copies(units, self.ties, set(held))
        wanted = reads_delays(method, options.stage.optimizer)
        delays = steady_delays(method, self.shape) if wanted else {}
        self.stages: dict[int, Stage] = {}
        # ZeRO-1: each stage's optimizer is built over its replicas' group (``sharded.py``)
        shard_group = self.replicas.data_group if options.stage.shard_optimizer else None
        for k, r in sorted(self.rank_of.items()):
            if r not in ranks:
                continue
            a, b = bounds[k]
            self.stages[k] = Stage(
                k,
                nn.Sequential(*units[a:b]),
                options.stage,
                num_stages=n_stages,
                method=method,
                micro_batches=self.shape.micro_batches,
                device=self.device,
                first_unit=a,
                delay=delays.get(k, 0),
                shard_group=shard_group,
            )
        self.model_record: dict[str, Any] = {}
        """The model's own tensor names and source (``ModelUnits``), written into
        checkpoints for ``pipeoptim export`` (empty: plain units)."""
        self.tie_exchange: TieExchange | None = None
        """Sums the gradients of weights shared across stages at each update (``ties.py``)."""
        # every rank makes the group (a collective), whether or not it holds a member
        tie_transport = self._tie_transport() if self.ties else None
        if tie_transport is not None and tie_transport.ordered:
            refuse_mixed_streams(method, self.ties, self.rank_of)
        if tied:
            for k, entries in tied.items():
                updater = self.stages[k].updater
                if updater is not None:
                    updater.tied = [p for _, p in entries if p.requires_grad]
            self.tie_exchange = TieExchange(tied, n_stages, self.rank_of, tie_transport, set(ranks))
            self.tie_exchange.align()
        if tied:  # the pipeline's clipping norm counts a shared weight on its first stage
            for k, entries in tied.items():
                updater = self.stages[k].updater
                if updater is not None:
                    updater.tied_elsewhere = [
                        p for tie, p in entries if p.requires_grad and tie.stages[0] != k
                    ]
        self.norm_board = self._norm_board()
        """The pipeline's squared gradient norms per update, where ``grad_clip`` bounds the
        pipeline's norm (``optim/global_clip.py``); None: each stage clips its own."""
        self._join_replicas()
        self._record_optimizer()
        self.stop_channel: StopChannel | None = None
        """Where a callback's stop travels between processes (None in one process; made by
        :meth:`open_stop_channel` once every rank has met)."""

    def open_stop_channel(self) -> None:
        """The stop channel's group, a collective of every rank: made after the ranks first
        met (a barrier), so a rank that died while building is reported as a lost peer by
        that barrier rather than waited for here."""
        if not self.process_model.one_process and self.stop_channel is None:
            decider = self.rank_of[self.last]  # replica 0's rank of the last stage
            self.stop_channel = StopChannel(dist.new_group(backend="gloo"), decider)

    def _norm_board(self) -> NormBoard | None:
        """The board of the pipeline's clipping norm; under dist over a process group of
        this replica's pipeline ranks made for it (every process makes every replica's, in
        order: ``new_group`` is a collective of the world)."""
        stage = self.options.stage
        if stage.grad_clip is None or stage.clip_scope != "pipeline":
            return None
        if self.process_model.one_process:
            return NormBoard(sorted(set(self.rank_of.values())))
        d, p = self.replicas.replicas, self.replicas.pipeline_ranks
        groups = [dist.new_group([r * p + i for i in range(p)]) for r in range(d)]
        return NormBoard(list(range(p)), groups[self.replicas.replica])

    def pipeline_clip(self, rank: int) -> PipelineClip | None:
        """Rank ``rank``'s side of clipping by the pipeline's norm (None: per stage)."""
        grad_clip = self.options.stage.grad_clip
        if self.norm_board is None or grad_clip is None:
            return None
        return PipelineClip(self.norm_board, grad_clip, rank)

    def _tie_transport(self) -> DistTransport | None:
        """The messages of weights shared across stages, over a process group of their own
        (NCCL matches a pair's messages in posting order); None in one process."""
        if self.process_model.one_process:
            return None
        return DistTransport(
            self.ranks[0],
            self.shape.num_stages,  # tags from stage numbers, which exceed ranks when V > 1
            self.device,
            first_rank=self.replicas.global_rank(0),
            group=dist.new_group(),
            one_tag=self.options.one_tag,
        )

    def _place(self, requested: str) -> tuple[torch.device, list[int]]:
        """This process's device and ranks; joins (or starts) the process group for dist."""
        if self.process_model.one_process:
            device = local_device(requested, self.plan.devices)
            return device, sorted(set(self.rank_of.values()))
        p, d = self.shape.num_ranks, self.plan.data_parallel
        device, rank, self.owns_group = join_group(
            p, requested, self.plan.devices, self.timeout, replicas=d
        )
        if self.store is None:
            self.store = dist.distributed_c10d._get_default_store()
        self.replicas = ReplicaGroups.build(d, p, device)
        return device, [rank % p]

    def _join_replicas(self) -> None:
        """Start every replica from replica 0's weights; average gradients before updates,
        and give every replica replica 0's buffers at each update (stages with floating
        buffers only: nothing is sent for the others, nor for D = 1); QK-Clip takes each
        head's max logit over the replicas, so they clip alike."""
        group = self.replicas.data_group
        if group is None:
            return
        self.replicas.broadcast_weights([s.module for s in self.stages.values()])
        for stage in self.stages.values():
            stage.replicas = self.replicas.replicas
            stage.grad_sync = GradientAverager(group, self.replicas.replicas)
            if BufferBroadcast.needed(stage.module):
                stage.buffer_sync = BufferBroadcast(group, stage.module)
            correction = None if stage.updater is None else stage.updater.correction
            if isinstance(correction, QKClip):  # S_h over every replica's share of the batch
                correction.replica_max = ReplicaMax(group)

    def _record_optimizer(self) -> None:
        """The plan (and trace) name the optimizer the stages actually built."""
        opt = next((s.optimizer for s in self.stages.values() if s.optimizer is not None), None)
        if opt is None:
            return
        family = FAMILY_OF_CLASS.get(optimizer_class_name(opt), self.plan.optimizer.family)
        lr = float(opt.param_groups[0]["lr"])
        self.plan.optimizer = OptimizerSpec(family, lr if lr > 0 else self.plan.optimizer.lr)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed: what fixes the state's shapes and
        the data order. The optimizer class is the one the stages here built (a rank whose
        stages have no weights leaves it out; it is compared only where both sides name it,
        so checkpoints written before it resume). Precision is not in it: a resume may
        change ``amp`` (a hyper-parameter). The batch size is known only once the first
        batch is read, so the checkpoint folder checks it then, before loading anything."""
        p, shape = self.plan, self.shape
        units = [[type(u).__name__, [list(t.shape) for t in u.parameters()]] for u in self.units]
        opt = next((s.optimizer for s in self.stages.values() if s.optimizer is not None), None)
        return {
            "method": p.method,
            "num_stages": p.num_stages,
            "micro_batches": shape.micro_batches,
            "virtual_stages": shape.virtual_stages,
            "prediction_offset": p.prediction_offset,
            "boundaries": [list(b) for b in self.bounds],
            "units": units,
            "seed": self.seed,
            **({"optimizer_class": optimizer_class_name(opt)} if opt is not None else {}),
            # only when set, so checkpoints written before the option resume unchanged
            **({"predicted_backward": True} if self.options.stage.predicted_backward else {}),
        }

    # -- sharing between ranks -------------------------------------------------------------
    def share(self, obj: Any, stage: int) -> Any:
        """``obj`` as computed on the rank of ``stage``, on every rank."""
        if self.process_model.one_process:
            return obj
        box = [obj]
        cuda = self.device.type == "cuda"
        dist.broadcast_object_list(
            box,
            src=self.replicas.global_rank(self.rank_of[stage]),
            group=self.replicas.pipeline_group,
            device=self.device if cuda else None,
        )
        return box[0]

    def on_first_rank(self, work: Any) -> Any:
        """Run ``work`` on stage 0's rank and share its result; an error there is raised on
        every rank (the original on stage 0's, its message elsewhere)."""
        return self.on_stage(0, work)

    def on_stage(self, stage: int, work: Any) -> Any:
        """Run ``work`` on the rank of ``stage`` and share its result, as
        :meth:`on_first_rank` does for stage 0."""
        out: Any = None
        error: BaseException | None = None
        if stage in self.stages:
            try:
                out = work()
            except BaseException as err:
                error = err
                out = ("error", str(err) if isinstance(err, PipeoptimError) else repr(err))
        out = self.share(out, stage)
        if error is not None:
            raise error
        if isinstance(out, tuple) and len(out) == 2 and out[0] == "error":
            raise RuntimeConfigError(f"stage {stage}'s rank failed: {out[1]}")
        return out
