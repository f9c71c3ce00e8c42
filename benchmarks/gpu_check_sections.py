"""The checks of ``benchmarks/gpu_check.py``, one function per section; each appends rows to
the report and asks its budget before every run. ``GPU_CHECK_SHARDED_ON_CPU=1`` runs the
D = 2 check's two processes on CPU over gloo, to try that path without GPUs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from gpu_check_runs import (
    QUICK,
    Size,
    batches,
    loss_tolerance,
    losses,
    pipeline,
    relative_differences,
    synchronize,
    time_ours,
    time_torch,
    worst_ratio,
)

MIB = 2**20
MEMORY_AGREEMENT = 0.05
"""Per stage on CPU, the model's peak against the runtime's count: the model's bytes are the
run's own counts, so they differ only where a sample missed a moment; 5 % allows that."""
DEVICE_SLACK = 1.25
DEVICE_WORKSPACE = 32 * MIB
"""On CUDA the allocator's peak holds every stage (one process) and a pass's transient
tensors the model does not count (a quarter more at most, said the check), plus cuBLAS's
workspace (up to 32 MiB)."""

STEADY_MINI_BATCHES = 2
"""Mini-batches per rank in a memory run: an asynchronous pipeline reaches its steady
peak after about P of them (at 3 mini-batches for P = 4, pipeoptim's and spectrain's first
ranks ended a weight copy below the peak the model gives the steady state; at 2P the two
agree to the byte on CPU)."""

TORCH_COUNTERPARTS: dict[str, tuple[str | None, str]] = {
    "gpipe": ("ScheduleLoopedBFS", "P stages on one rank: its order there is GPipe's"),
    "1f1b": (None, "Schedule1F1B holds one stage per rank: P stages need P processes"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "P x v stages on one rank"),
    "zb-h1": (
        "ScheduleInterleavedZeroBubble",
        "PyTorch's ZB-H1 form is the interleaved one: P stages on one rank",
    ),
    "zb-v": ("ScheduleZBVZeroBubble", "exactly 2 stages per rank: one process is P = 1"),
    "dualpipev": ("ScheduleDualPipeV", "exactly 2 stages per rank: one process is P = 1"),
}
"""Our synchronous methods and PyTorch's schedule that runs them with every stage in one
process (one rank, a group of one), or None and why it cannot."""


def row(
    check: str, subject: str, status: str, measured: str, bound: str, **values: Any
) -> dict[str, Any]:
    return {
        "check": check,
        "subject": subject,
        "status": status,
        "measured": measured,
        "bound": bound,
        "values": values,
    }


def _verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def check_losses(report: Any, methods: list[str]) -> None:
    """Every method: its first steps' losses on the device against the same run on the CPU
    (fp32) and against the CPU's float64 run."""
    size, device = report.size, report.device
    for method in methods:
        if not report.budget.allows(f"losses {method}"):
            return
        with report.item("losses", method):
            ref = losses(method, size, "cpu", torch.float64)
            ours = losses(method, size, device, torch.float32)
            cpu = ours if device == "cpu" else losses(method, size, "cpu", torch.float32)
            vs_cpu = worst_ratio(ours, cpu, size, 2.0, None)
            vs_ref = worst_ratio(ours, ref, size, 1.0, None)
            same = "the device run is the CPU run" if device == "cpu" else ""
            report.add(
                row(
                    "losses fp32",
                    method,
                    _verdict(vs_cpu <= 1 and vs_ref <= 1),
                    f"vs CPU fp32 {max(relative_differences(ours, cpu)):.1e}, "
                    f"vs fp64 {max(relative_differences(ours, ref)):.1e}",
                    f"{2 * loss_tolerance(size, 0):.1e}, {loss_tolerance(size, 0):.1e} x (t+1)",
                    device_losses=ours,
                    cpu_fp32_losses=cpu,
                    cpu_fp64_losses=ref,
                    worst_over_bound_vs_cpu=vs_cpu,
                    worst_over_bound_vs_fp64=vs_ref,
                    note=same,
                )
            )


def check_precision(report: Any, method: str) -> None:
    """bf16 autocast on the device against the CPU's float64 run."""
    size, device = report.size, report.device
    if not report.budget.allows("bf16"):
        return
    with report.item("bf16 autocast", method):
        ref = losses(method, size, "cpu", torch.float64)
        ours = losses(method, size, device, torch.float32, amp="bf16")
        ratio = worst_ratio(ours, ref, size, 1.0, "bf16")
        report.add(
            row(
                "bf16 autocast",
                method,
                _verdict(ratio <= 1),
                f"vs fp64 {max(relative_differences(ours, ref)):.1e}",
                f"{loss_tolerance(size, 0, 'bf16'):.1e} x (t+1)",
                device_losses=ours,
                cpu_fp64_losses=ref,
                worst_over_bound=ratio,
            )
        )


def _peak_run(
    method: str, size: Size, device: str, steps: int | None = None, **options: Any
) -> dict[str, Any]:
    """One run of ``steps`` (default ``size.steps``) mini-batches with a memory sample at
    every action: its losses, trace, and on CUDA the allocator's peak over what was
    allocated before."""
    steps = steps or size.steps
    cuda = device.startswith("cuda")
    if cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    pipe = pipeline(method, size, device, memory_every=1, **options)
    try:
        result = pipe.fit(batches(size, steps), max_steps=steps)
        synchronize(device)
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
        return {"losses": list(result.losses), "trace": pipe.trace(), "device_peak": peak}
    finally:
        pipe.close()


def _stage_peaks(trace: Any) -> dict[int, int]:
    from pipeoptim.metrics import compute_metrics

    return {
        k: int(s.peak_memory_bytes or 0) for k, s in sorted(compute_metrics(trace).stages.items())
    }


def check_recompute(report: Any, method: str) -> None:
    """Full recomputation against none: the same losses (the forward is repeated, not
    changed), and the memory each run held."""
    size, device = report.size, report.device
    if not report.budget.allows("recompute"):
        return
    with report.item("recompute", method):
        kept = _peak_run(method, size, device)
        redone = _peak_run(method, size, device, recompute="full")
        ratio = worst_ratio(redone["losses"], kept["losses"], size, 2.0, None)
        if device.startswith("cuda"):
            held = (kept["device_peak"], redone["device_peak"])
            where = "device peak"
        else:
            held = (
                sum(_stage_peaks(kept["trace"]).values()),
                sum(_stage_peaks(redone["trace"]).values()),
            )
            where = "runtime count, stages summed"
        saved = 1 - held[1] / held[0] if held[0] else 0.0
        report.add(
            row(
                "recompute full",
                method,
                _verdict(ratio <= 1 and held[1] <= held[0]),
                f"losses {max(relative_differences(redone['losses'], kept['losses'])):.1e}; "
                f"{where} {held[0] / MIB:.2f} -> {held[1] / MIB:.2f} MiB "
                f"({100 * saved:.0f} % saved)",
                f"{2 * loss_tolerance(size, 0):.1e} x (t+1); no more memory",
                losses_none=kept["losses"],
                losses_full=redone["losses"],
                bytes_none=held[0],
                bytes_full=held[1],
            )
        )


def check_memory(report: Any, methods: list[str]) -> None:
    """The memory model (the simulator on the run's own calibrated costs) per stage against
    the runtime's count (CPU) or the allocator's peak (CUDA, every stage on one device)."""
    from pipeoptim.calibrate import predict_run

    size, device = report.size, report.device
    steps = max(size.steps, STEADY_MINI_BATCHES * size.ranks)
    for method in methods:
        if not report.budget.allows(f"memory {method}"):
            return
        with report.item("memory", method):
            run = _peak_run(method, size, device, steps)
            predicted = _stage_peaks(predict_run(run["trace"]))
            per_stage = {str(k): v for k, v in predicted.items()}
            if device.startswith("cuda"):
                peak, low, high = (
                    run["device_peak"],
                    max(predicted.values()),
                    sum(predicted.values()),
                )
                ok = low <= peak <= DEVICE_SLACK * high + DEVICE_WORKSPACE
                report.add(
                    row(
                        "memory model",
                        f"{method}, device",
                        _verdict(ok),
                        f"max_memory_allocated {peak / MIB:.2f} MiB; model: largest stage "
                        f"{low / MIB:.2f}, all {high / MIB:.2f} MiB",
                        f"largest stage .. {DEVICE_SLACK} x all + {DEVICE_WORKSPACE // MIB} MiB",
                        device_peak=peak,
                        predicted_per_stage=per_stage,
                        mini_batches=steps,
                        note="one process holds every stage: the allocator's peak is "
                        "theirs together",
                    )
                )
                continue
            counted = _stage_peaks(run["trace"])
            rank_of = {e.stage: e.rank for e in run["trace"].events}
            model_rank: dict[int, int] = {}
            count_rank: dict[int, int] = {}
            for k, c in counted.items():
                model_rank[rank_of[k]] = model_rank.get(rank_of[k], 0) + predicted[k]
                count_rank[rank_of[k]] = count_rank.get(rank_of[k], 0) + c
            worst = max(abs(model_rank[r] - c) / c for r, c in count_rank.items() if c)
            split = any(predicted[k] != c for k, c in counted.items()) and worst == 0
            report.add(
                row(
                    "memory model",
                    f"{method}, per stage",
                    _verdict(worst <= MEMORY_AGREEMENT),
                    "model/count KiB "
                    + " ".join(
                        f"{predicted[k] / 1024:.1f}/{c / 1024:.1f}" for k, c in counted.items()
                    ),
                    f"each rank's stages within {100 * MEMORY_AGREEMENT:.0f} %",
                    predicted_per_stage=per_stage,
                    mini_batches=steps,
                    counted_per_stage={str(k): v for k, v in counted.items()},
                    worst_rank_difference=worst,
                    note="CPU: against the runtime's own byte count"
                    + (
                        "; calibration splits a rank's weights and optimizer state evenly "
                        "among its stages, so its stages differ where their sum agrees"
                        if split
                        else ""
                    ),
                )
            )


def one_method_per_weight_policy(methods: list[str]) -> list[str]:
    """The first of ``methods`` of each weight policy, and of each stages-per-rank layout."""
    from pipeoptim.plan.methods.registry import METHODS

    seen: set[tuple[Any, bool]] = set()
    out = []
    for name in methods:
        spec = METHODS[name]
        key = (spec.weight_policy, spec.places_several_stages_per_rank)
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def shared_device_step(trace: Any) -> float:
    """The calibrated simulator's steady time per mini-batch of ``trace``'s run with its P
    ranks sharing one device (``Machine(1, P, 1)``: processor sharing), as a one-process run
    has them: every stage takes turns on the one GPU or thread."""
    import dataclasses

    from pipeoptim.calibrate.runs import trace_plan
    from pipeoptim.calibrate.trace_costs import costs_from_trace
    from pipeoptim.metrics import compute_metrics
    from pipeoptim.plan.machine import Machine
    from pipeoptim.sim.evaluate import evaluate_trace

    plan = trace_plan(trace)
    shape = plan.shape(int(trace.meta["mini_batches"]))
    costs = dataclasses.replace(costs_from_trace(trace), machine=Machine(1, shape.num_ranks, 1))
    rate = compute_metrics(evaluate_trace(plan.method, shape, costs)).steady_throughput
    return float(trace.meta.get("batch_size") or 1) / rate


def check_calibration(report: Any, methods: list[str]) -> None:
    """Each method's run calibrated from its own trace as ``pipeoptim calibrate`` does (each
    rank on a device of its own), and on one device the ranks share: the predicted time per
    mini-batch (steady state) and throughput against the run's."""
    from pipeoptim.calibrate import calibrate

    size, device = report.size, report.device
    for method in methods:
        if not report.budget.allows(f"calibration {method}"):
            return
        with report.item("calibration", method):
            run = time_ours(method, size, device)
            _, rows = calibrate(run.trace)
            found = {r.quantity: r for r in rows}
            step = found["time per mini-batch (steady state)"]
            whole = found["whole-run throughput"]
            shared = shared_device_step(run.trace)
            shared_error = (shared - step.measured) / step.measured
            report.add(
                row(
                    "calibrated simulator",
                    method,
                    "info",
                    f"time/mini-batch {step.measured * 1e3:.2f} ms; predicted "
                    f"{step.predicted * 1e3:.2f} ({100 * step.relative_error:+.0f} %), "
                    f"one device shared {shared * 1e3:.2f} ({100 * shared_error:+.0f} %); "
                    f"throughput {100 * whole.relative_error:+.0f} %",
                    "reported, not bounded",
                    rows=[r.to_dict() for r in rows],
                    shared_device_step_s=shared,
                    shared_device_relative_error=shared_error,
                    wall_samples_per_s=run.samples_per_s,
                    note="as pipeoptim calibrate: a device per rank; one device shared: "
                    "the P ranks take turns on one, as this one-process run has them",
                )
            )


def check_against_torch(report: Any, methods: list[str]) -> None:
    """Each synchronous method against PyTorch's schedule that runs it in one process:
    throughput (same device, same split, same micro-batches) and losses (synchronous: the
    same updates, within the fp32 bound of two runs)."""
    from pipeoptim.plan.methods.registry import FLUSHING

    size, device = report.size, report.device
    for method in [m for m in methods if m in FLUSHING]:
        schedule, why = TORCH_COUNTERPARTS.get(
            method, (None, "no PyTorch counterpart is named for it in gpu_check's table")
        )
        if schedule is None:
            report.add(row("vs PyTorch", method, "skip", "-", "-", note=why))
            continue
        if not report.budget.allows(f"vs PyTorch {method}"):
            return
        with report.item("vs PyTorch", method):
            v_pair = "2 stages per rank" in why
            options: dict[str, Any] = {"stages": 1, "micro_batches": size.ranks} if v_pair else {}
            ours = time_ours(method, size, device, **options)
            micro = int(ours.trace.meta.get("micro_batches") or size.ranks)
            assert ours.bounds is not None
            theirs = time_torch(schedule, ours.bounds, micro, size, device)
            ratio = ours.samples_per_s / theirs.samples_per_s
            agree = worst_ratio(ours.losses, theirs.losses, size, 2.0, None)
            apart = max(relative_differences(ours.losses, theirs.losses))
            report.add(
                row(
                    "vs PyTorch",
                    f"{method} / {schedule}",
                    _verdict(agree <= 1),
                    f"{ours.samples_per_s:,.0f} vs {theirs.samples_per_s:,.0f} samples/s "
                    f"({ratio:.2f}x); losses {apart:.1e}",
                    f"losses {2 * loss_tolerance(size, 0):.1e} x (t+1); speed reported",
                    ours_samples_per_s=ours.samples_per_s,
                    torch_samples_per_s=theirs.samples_per_s,
                    ratio=ratio,
                    stages=len(ours.bounds),
                    micro_batches=micro,
                    note=why,
                )
            )


def start_group(device: str) -> None:
    """A process group of one for PyTorch's schedules (every stage on this rank)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore

    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)


def stop_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def sharded_worker(shard: bool, steps: int, out: Path) -> None:
    """One rank of the D = 2 run (under torchrun): one stage per replica on its own device,
    AdamW; writes its losses and optimizer bytes."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from gpu_check_runs import units

    from pipeoptim import Pipeline
    from pipeoptim.plan.plan import OptimizerSpec

    size = QUICK
    device = "cpu" if os.environ.get("GPU_CHECK_SHARDED_ON_CPU") else "cuda"
    pipe = Pipeline(
        units(size),
        method="1f1b",
        stages=1,
        micro_batches=2,
        optimizer=OptimizerSpec("adamw", 1e-3),
        loss_fn=F.cross_entropy,
        transport="dist",
        device=device,
        data_parallel=2,
        shard_optimizer=shard,
        timeout=120,
    )
    result = pipe.fit(batches(size, steps), max_steps=steps)
    stage = next(iter(pipe.stages.values()))
    record = {"losses": list(result.losses), "optimizer": stage.memory()["optimizer"]}
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(record))
    pipe.close()


def _launch_sharded(script: str, shard: bool, steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        argv += ["--master-port", str(port), script, "--sharded-worker", str(steps), tmp]
        argv += ["--shard"] if shard else []
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"the D = 2 run failed:\n{done.stderr[-2000:]}")
        return [json.loads((Path(tmp) / f"rank-{r}.json").read_text()) for r in range(2)]


def check_sharded(report: Any, script: str) -> None:
    """ZeRO-1 at D = 2 (one process per replica, NCCL, a GPU each): the losses of the sharded
    run against the unsharded one, and each replica's optimizer bytes."""
    count = torch.cuda.device_count() if report.device.startswith("cuda") else 0
    on_cpu = bool(os.environ.get("GPU_CHECK_SHARDED_ON_CPU"))
    if count < 2 and not on_cpu:
        why = (
            "--device cpu: the D = 2 check runs one process per replica on two GPUs"
            if report.device == "cpu"
            else f"{count} GPU visible: the D = 2 check needs two (one per replica)"
        )
        report.add(row("sharded state D=2", "1f1b", "skip", "-", "-", note=why))
        return
    if not report.budget.allows("sharded"):
        return
    with report.item("sharded state D=2", "1f1b"):
        size = QUICK  # the worker's size
        whole = _launch_sharded(script, False, size.steps)
        shard = _launch_sharded(script, True, size.steps)
        ratio = worst_ratio(shard[0]["losses"], whole[0]["losses"], size, 2.0, None)
        halves = [s["optimizer"] / w["optimizer"] for s, w in zip(shard, whole, strict=True)]
        report.add(
            row(
                "sharded state D=2",
                "1f1b",
                _verdict(ratio <= 1 and max(halves) < 0.75),
                f"losses {max(relative_differences(shard[0]['losses'], whole[0]['losses'])):.1e}; "
                f"optimizer bytes sharded/whole {', '.join(f'{h:.2f}' for h in halves)}",
                f"{2 * loss_tolerance(size, 0):.1e} x (t+1); each replica < 0.75 of the whole",
                sharded=shard,
                whole=whole,
            )
        )
