"""The fit loop's dry run, evaluation and results: the probe that finds the receive shapes
and builds the executors, the forward-only evaluation, and every rank's share of the result.

Why apart from the training loop: a Pipeline evaluates and reports without training, and
the training loop (``fit_loop.py``) only adds the segments over these.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime import host_allocator
from pipeoptim.runtime.boundary import VARIES, loosened
from pipeoptim.runtime.executor import (
    Boundary,
    RankExecutor,
    RankResult,
    TensorSpec,
    drive_local,
)
from pipeoptim.runtime.feed import (
    BatchSpec,
    EvalReader,
)
from pipeoptim.runtime.fit_watch import FitWatching
from pipeoptim.runtime.observe.callbacks import (
    EvalEnd,
)
from pipeoptim.runtime.payload import Payload, batch_len, head
from pipeoptim.runtime.probe import probe_stage, probe_stages, stand_in
from pipeoptim.runtime.result import EvalResult, FitResult, build_trace, merge
from pipeoptim.runtime.segments import (
    eval_plan,
)
from pipeoptim.trace import Trace

__all__ = ["FitEvaluation"]


class FitEvaluation(FitWatching):
    """The dry run, the executors, evaluation and the results of one process's ranks."""

    def _probe(self, x: Payload, y: Tensor, training: bool = False) -> dict[str, Any]:
        """Two samples through every stage: receive shapes, and user errors found early
        (``training``: also a loss that no trainable parameter reaches, once per loop)."""
        p = self.parts
        if p.chained_probe:  # stage by stage on every rank, once the sample is shared
            sample = (head(x, 2), y[:2])
            return {
                "spec": BatchSpec.of(x, y),
                "boundaries": None,
                "sample": sample,
                "training": training,
            }
        s = p.options.stage
        boundaries = probe_stages(
            p.units, p.bounds, head(x, 2), y[:2], s.loss_fn, s.amp, p.device, training=training
        )
        self.probed_training = self.probed_training or training
        return {"spec": BatchSpec.of(x, y), "boundaries": boundaries}

    def _probe_chain(self, x: Payload, y: Tensor, training: bool) -> list[Boundary]:
        """The dry run of a model no rank holds whole: each rank runs its own stages, on the
        data (stage 0), on the output of its stage before, or on zeros of the shapes the
        previous stage's rank shared; an error is raised on every rank."""
        p = self.parts
        n = batch_len(x)
        specs: list[Boundary] = []
        h: Payload = x
        for k in range(len(p.bounds)):
            kept: list[Payload] = []  # this rank's output of stage k, for its stage k + 1

            def run(k: int = k, h: Payload = h, kept: list[Payload] = kept) -> Boundary:
                given = h if k == 0 or k - 1 in p.stages else stand_in(specs[k - 1], n, p.device)
                spec, out = probe_stage(
                    p.units, p.bounds, k, given, n, y, p.options.stage.loss_fn,
                    p.options.stage.amp, p.device,
                    training=training,
                )  # fmt: skip
                kept.append(out)
                return spec

            specs.append(p.on_stage(k, run))
            if kept:
                h = kept[0]
        self.probed_training = self.probed_training or training
        return specs

    def _adopt(self, info: dict[str, Any]) -> None:
        """Take the run's shapes (from the probe) and build the executors once."""
        spec: BatchSpec = info["spec"]
        if "sample" in info:  # a model no rank holds whole: every rank runs its stages
            sample_x, sample_y = info["sample"]
            chained = self._probe_chain(sample_x, sample_y, bool(info["training"]))
            info = {**info, "boundaries": info["boundaries"] or chained}
        if self.spec is None:
            self.boundaries = info["boundaries"]
            self._target = TensorSpec(spec.target_shape, spec.target_dtype)
            self.spec = spec.varying() if self.parts.options.varying_shapes else spec
            self._build_executors()
        self.spec = replace(self.spec, batch_size=spec.batch_size)

    def _build_executors(self) -> None:
        assert self.boundaries is not None and self._target is not None
        p = self.parts
        boundaries, target = self.boundaries, self._target
        if p.options.varying_shapes:  # the receives take their sizes from the messages
            boundaries = [loosened(b) for b in boundaries]
            target = TensorSpec((VARIES,) * len(target.shape), target.dtype)
        for rank in sorted(p.transports):
            mine = {k: s for k, s in p.stages.items() if p.rank_of[k] == rank}
            self._executors.append(
                RankExecutor(
                    rank,
                    mine,
                    p.transports[rank],
                    boundaries=boundaries,
                    target=target,
                    micro_size=1,
                    rank_of=p.rank_of,
                    recorder=self.recorder,
                    on_step=self._on_step if p.last in mine else None,
                    memory_every=self.options.memory_every,
                )
            )
            self._executors[-1].ties = p.tie_exchange
            self._executors[-1].clip = p.pipeline_clip(rank)

    def _drive(self) -> None:
        """Run every rank of this process to the end of the current schedule."""
        if len(self._executors) == 1:
            self._executors[0].run()
        else:
            drive_local(self._executors)
        for t in self.parts.transports.values():
            t.flush()

    def evaluate(self, data: Iterable[Any], final: bool = False) -> EvalResult:
        """Loss (and accuracy) of the live weights on ``data``: a forward-only schedule."""
        result = self._evaluate(data)
        if self.callbacks:
            info = EvalEnd(
                self.state.step,
                result.loss,
                result.accuracy,
                result.samples,
                final,
                self.decides,
                self._stop,
            )
            self.callbacks.call("on_eval_end", info)
        return result

    def _evaluate(self, data: Iterable[Any]) -> EvalResult:
        parts = self.parts
        reader = EvalReader(data, self.spec) if 0 in parts.stages else None
        modes = {k: s.module.training for k, s in parts.stages.items()}
        for s in parts.stages.values():
            s.module.eval()  # dropout off, batch-norm statistics frozen
        first = 0
        try:
            while True:
                chunk: list[tuple[Payload, Tensor]] = []

                def read(
                    first: int = first, chunk: list[tuple[Payload, Tensor]] = chunk
                ) -> dict[str, Any]:
                    chunk[:] = reader.next_chunk() if reader is not None else []
                    if not chunk and first == 0:
                        raise RuntimeConfigError(
                            "the evaluation data is empty; give it at least one batch"
                        )
                    probe = self._probe(*chunk[0]) if chunk and self.spec is None else None
                    return {"sizes": [batch_len(x) for x, _ in chunk], "probe": probe}

                info = parts.on_first_rank(read)
                if info["probe"] is not None:
                    self._adopt(info["probe"])
                sizes: list[int] = info["sizes"]
                if not sizes:
                    break
                placement = tuple(sorted(parts.rank_of.items()))
                plan = eval_plan(placement, len(sizes))
                self.state.busy = True
                for ex in self._executors:
                    ex.begin_eval(plan, sizes, first, chunk if 0 in ex.stages else None)
                self._drive()
                self.state.busy = False
                first += len(sizes)
        finally:
            for k, s in parts.stages.items():
                s.module.train(modes[k])
            for ex in self._executors:
                ex.end_eval()
        return self._eval_result()

    def _eval_result(self) -> EvalResult:
        out: dict[str, Any] | None = None
        for ex in self._executors:
            sums = ex.eval_sums
            if sums is not None:
                # weighted by tokens where targets are ignored (stage.loss.evaluation_weight)
                weight = float(sums.weight)
                loss = float(sums.loss) / weight if weight > 0 else math.nan
                acc = int(sums.correct) / sums.targets if sums.classifier else None
                out = {
                    "loss": loss,
                    "accuracy": acc,
                    "samples": sums.samples,
                    "step": self.state.step,
                }
                ex.eval_sums = None
        shared = self.parts.share(out, self.parts.last)
        if shared is None:
            raise RuntimeError("the evaluation produced no result on the last stage")
        self.result.evals.append(shared)
        return EvalResult.from_dict(shared)

    def rank_result(self) -> RankResult:
        """This process's share so far (after a failure too: the trace of what ran)."""
        self.recorder.resolve()
        res, stages = self.result, self.parts.stages
        res.events, res.memory = self.recorder.events, self.recorder.memory
        res.weight_copies = {k: s.peak_weight_copies for k, s in stages.items()}
        res.meta = self.meta()
        res.predict_s = {
            k: seconds for k, s in stages.items() if (seconds := s.prediction_s) is not None
        }
        res.recompute_held_bytes = {
            k: held for k, s in stages.items() if (held := s.recompute_held_bytes)
        }
        res.notes = [*self.state.notes, *sorted({n for s in stages.values() for n in s.notes})]
        return res

    def meta(self) -> dict[str, Any]:
        """The run's metadata, as the trace records it."""
        p = self.parts
        ranks = p.shape.num_ranks
        device = str(p.device) if p.process_model.one_process else f"{p.device.type} x{ranks}"
        return {
            "transport": p.process_model.value,
            "device": device,
            "hyperparameters": self.hyperparameters,
            "resumed_with_changes": self.state.resumed_with,
            "trace_truncated": self.recorder.truncated,
            "model": p.plan.model or "custom",
            # the layer ranges the stages ran (the plan may leave them to the even split)
            "boundaries": [list(b) for b in p.bounds],
            "num_layers": len(p.units),
            "threads": torch.get_num_threads(),  # CPU threads each rank computed with
            "host_allocator": host_allocator.applied(),  # glibc thresholds set; {}: none
            # replicas of the pipeline; the events are replica 0's (they run alike)
            "data_parallel": p.replicas.replicas,
        }

    def merged(self) -> FitResult:
        """Every rank's result of this replica's pipeline, merged (the same on every rank)."""
        mine = self.rank_result()
        p = self.parts
        if not p.process_model.one_process:  # this replica's pipeline
            texts: list[Any] = [None] * p.shape.num_ranks
            dist.all_gather_object(texts, mine.to_json(), group=p.replicas.pipeline_group)
            results = [RankResult.from_json(t) for t in texts]
        else:
            results = [mine]
        merged = merge(p.plan, results, self.meta())
        self.trace = merged.trace
        return merged

    def partial(self) -> FitResult:
        """What ran so far, merged from this process alone (a failed local run)."""
        return merge(self.parts.plan, [self.rank_result()], self.meta())

    def trace_so_far(self) -> Trace:
        """The trace of what ran so far in this process."""
        return build_trace(self.parts.plan, [self.rank_result()], self.meta())
