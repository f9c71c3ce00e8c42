"""The methods: each a :class:`Method` object carrying its schedule generator, its size
rules, its weight-version rule and the :class:`StagePolicy` each of its stages follows.

One concern per module: ``base`` (the method, the policy, the questions),
``synchronous`` (gpipe, 1f1b, interleaved-1f1b), ``zero_bubble`` (zb-h1, zb-v),
``asynchronous`` (pipedream, 2bw, spectrain, xpipe, pipeoptim), ``combinators`` (methods
built from methods: corrections, shrink, bounded) and ``registry`` (the one list, the look-up
and the derived sets).
"""

from pipeoptim.plan.methods.base import (
    BackwardReads,
    ForwardReads,
    Method,
    StagePolicy,
    WeightPolicy,
)
from pipeoptim.plan.methods.registry import (
    CORRECTED,
    FLUSHING,
    METHODS,
    RANKED_BY_DEFAULT,
    build_schedule,
    check_schedule_size,
    get_method,
    registered,
)

__all__ = [
    "CORRECTED",
    "FLUSHING",
    "METHODS",
    "RANKED_BY_DEFAULT",
    "BackwardReads",
    "ForwardReads",
    "Method",
    "StagePolicy",
    "WeightPolicy",
    "build_schedule",
    "check_schedule_size",
    "get_method",
    "registered",
]
