"""Simulate a plan before spending GPU hours: a SimPy engine and a fast evaluator.

Pure Python plus SimPy; never imports torch. Both engines read one
:class:`~pipeoptim.sim.costs.CostModel` and one compiled order
(:class:`~pipeoptim.sim.program.Program`) and agree exactly when there is no jitter and no
link contention. Data-parallel replicas of the pipeline (PP x DP) are one replica's run
whose updates carry the all-reduce (:mod:`pipeoptim.sim.collectives`). Ranks that share a
host's cores run by processor sharing in both engines (:mod:`pipeoptim.sim.sharing`),
still bit-equal. The SimPy engine
emits the shared :class:`~pipeoptim.trace.Trace`; :func:`pipeoptim.metrics.compute_metrics`
reads it.
"""

from pipeoptim.sim.collectives import Cluster, ring_allreduce_s
from pipeoptim.sim.costs import CostModel, parse_uniform
from pipeoptim.sim.engine import build_trace, run_simpy, simulate, simulate_order
from pipeoptim.sim.evaluate import (
    Evaluation,
    compile_method,
    evaluate_method,
    evaluate_program,
    evaluate_trace,
    list_schedule,
)
from pipeoptim.sim.memory import MemoryReport, StagePeak, memory_report
from pipeoptim.sim.program import Program, Timing

__all__ = [
    "Cluster",
    "CostModel",
    "Evaluation",
    "MemoryReport",
    "Program",
    "StagePeak",
    "Timing",
    "build_trace",
    "compile_method",
    "evaluate_method",
    "evaluate_program",
    "evaluate_trace",
    "list_schedule",
    "memory_report",
    "parse_uniform",
    "ring_allreduce_s",
    "run_simpy",
    "simulate",
    "simulate_order",
]
