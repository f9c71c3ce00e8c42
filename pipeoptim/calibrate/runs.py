"""What a measured run recorded, read from its trace: its plan, replicas, cluster, machine,
layer boundaries and the latency of each link."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from pipeoptim.calibrate.clocks import align_clocks
from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.replicas import check_replicas
from pipeoptim.sim.collectives import Cluster
from pipeoptim.trace import Trace


def trace_plan(trace: Trace) -> Plan:
    data = trace.meta.get("plan")
    if trace.meta.get("source") != "runtime" or not isinstance(data, dict):
        raise PipeoptimError(
            "calibration needs a trace written by `pipeoptim train --trace FILE` (its meta "
            f"has source 'runtime' and the plan); this one has source "
            f"{trace.meta.get('source')!r}"
        )
    return Plan.from_dict(data, source="the trace's plan")


def run_replicas(trace: Trace) -> int:
    """D: the replicas of the measured pipeline (``meta["data_parallel"]``, else the plan's;
    1 for a trace from before replicas were recorded)."""
    raw = trace.meta.get("data_parallel")
    if raw is None:
        return trace_plan(trace).data_parallel
    return check_replicas(raw, "the trace's meta data_parallel", error=PipeoptimError)


_CLUSTER_NOTES = ("bandwidth_bytes_per_s", "latency_s", "gpus_per_node")


def cluster_recorded(trace: Trace) -> bool:
    """Whether the run's plan records the cluster it was made for (in its notes)."""
    return any(key in trace_plan(trace).notes for key in _CLUSTER_NOTES)


def run_cluster(trace: Trace) -> Cluster:
    """The links the run's all-reduce is modelled on: the cluster its plan records in its
    notes (a plan from ``pipeoptim plan --devices``; None there is a free bandwidth), else
    one tier at the run's median measured link latency with free bandwidth (the ranks of a
    run on one machine talk over the same transport as its pipeline links)."""
    plan = trace_plan(trace)
    notes = plan.notes
    latencies = link_latencies(align_clocks(trace).trace, plan.shape(1).num_stages)
    measured = statistics.median(latencies) if latencies else 0.0
    if not cluster_recorded(trace):
        return Cluster(math.inf, measured)

    def number(key: str, default: float | None) -> float | None:
        value = notes.get(key, default)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return None if value is None else float(value)
        raise PipeoptimError(
            f"the trace's plan notes {key} must be a number (got {value!r}); fix the plan's "
            f"notes, or pass the cluster to `pipeoptim calibrate` (--bandwidth, --latency, "
            f"--gpus-per-node, --inter-node-bandwidth, --inter-node-latency)"
        )

    bandwidth = number("bandwidth_bytes_per_s", None)
    latency = number("latency_s", measured)
    gpus = notes.get("gpus_per_node")
    inter_bw = inter_lat = None
    if gpus is not None and "inter_node_bandwidth_bytes_per_s" in notes:
        value = number("inter_node_bandwidth_bytes_per_s", None)
        inter_bw = math.inf if value is None else value
    if gpus is not None:
        inter_lat = number("inter_node_latency_s", None)
    return Cluster(
        math.inf if bandwidth is None else bandwidth,
        measured if latency is None else latency,
        gpus,
        inter_bw,
        inter_lat,
    )


def run_machine(trace: Trace) -> Machine | None:
    """The host the run's ranks shared, as its trace records it (None: not recorded)."""
    data = trace.meta.get("machine")
    if data is None:
        return None
    try:
        return Machine.from_dict(data, "the trace's machine record")
    except PipeoptimError as err:
        raise PipeoptimError(f"{err} (in the trace's meta)") from None


def stage_floats(data: object) -> dict[int, float]:
    """``{"0": 0.01, ...}`` from a trace's meta as ``{0: 0.01}`` (nothing when absent)."""
    if not isinstance(data, dict):
        return {}
    return {int(k): float(v) for k, v in data.items()}


def link_latencies(trace: Trace, num_stages: int) -> list[float]:
    """Median arrival delay per edge, both directions: receive end minus the later of the
    send's start and the receive's start (a receive posted late finds the data there)."""
    starts = {
        (e.kind, e.stage, e.mb): e for e in trace.events if e.kind.startswith(("SEND", "RECV"))
    }
    delays: dict[int, list[float]] = defaultdict(list)
    for (kind, stage, mb), recv in starts.items():
        if kind == "RECV_F":
            send, edge = starts.get(("SEND_F", stage - 1, mb)), stage - 1
        elif kind == "RECV_B":
            send, edge = starts.get(("SEND_B", stage + 1, mb)), stage
        else:
            continue
        if send is not None:
            delays[edge].append(max(0.0, recv.end - max(send.start, recv.start)))
    return [statistics.median(delays[k]) if delays[k] else 0.0 for k in range(num_stages - 1)]


def run_boundaries(trace: Trace) -> list[tuple[int, int]]:
    """The layer ranges the measured run's stages held (its plan's, or the even split the
    runtime recorded)."""
    plan = trace_plan(trace)
    raw = plan.boundaries or trace.meta.get("boundaries")
    if not raw:
        raise PipeoptimError(
            "the trace records no layer boundaries (a trace from an older pipeoptim, or a "
            "model that was not split by layers); rerun `pipeoptim train --trace FILE` with "
            "this version"
        )
    return [(int(a), int(b)) for a, b in raw]
