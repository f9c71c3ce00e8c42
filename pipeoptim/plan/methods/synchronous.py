"""The synchronous methods: every micro-batch of mini-batch t reads W^(t), and the pipeline
drains (flushes) before the one update."""

from __future__ import annotations

from pipeoptim.plan import schedules
from pipeoptim.plan.methods.base import Method, WeightPolicy

GPIPE = Method(
    "gpipe",
    "GPipe: all forwards then all backwards of M micro-batches, one update, flush",
    schedules.gpipe,
    WeightPolicy.FLUSH,
    # every micro-batch's activations are held until the backwards start
    slots_rule=lambda k, p, m: m,
)

ONE_F_ONE_B = Method(
    "1f1b",
    "1F1B with a flush per mini-batch (PipeDream-Flush, DAPPLE); needs M >= P",
    schedules.one_f_one_b,
    WeightPolicy.FLUSH,
    min_micro_batches_per_stage=True,
)

INTERLEAVED_1F1B = Method(
    "interleaved-1f1b",
    "interleaved 1F1B (Megatron-LM): v stages per rank, flush; M a multiple of P",
    schedules.interleaved_one_f_one_b,
    WeightPolicy.FLUSH,
    min_micro_batches_per_stage=True,
    interleaved=True,
)
