"""The checks the options tree and ``pipeoptim train`` share: the ranges, the whole-number
test, and the run's shape (its plan, prediction offset and replicas), torch-free.

Why apart from the groups: ``runtime/config.py`` (``pipeoptim train``'s configuration, which
takes its shared options' defaults and checks from the groups) and the groups both use them,
and neither may import the other's module first.
"""

from __future__ import annotations

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.replicas import check_replicas as plan_replicas
from pipeoptim.runtime.comm.process_model import ProcessModel

__all__ = [
    "AMP_MODES",
    "MAX_SEED",
    "MAX_TIMEOUT",
    "check_offset",
    "check_replicas",
    "check_whole",
    "is_whole",
    "resolve_plan",
]

AMP_MODES = ("bf16", "fp16")

MAX_SEED = 2**32 - 1
"""Seeds go up to this: per-stage and per-epoch seeds derived from it must fit in 64 bits."""

MAX_TIMEOUT = 1e9
"""Seconds a rank may wait for another at most (about 31 years): the process group holds
its timeout as a ``timedelta``, which overflows past about 8.6e13 s (and at infinity)."""


def is_whole(value: object, minimum: int | None = 0, maximum: int | None = None) -> bool:
    """``value`` is a whole number (an ``int``, not a ``bool``) in ``minimum..maximum`` (None:
    unbounded): the one test behind every count the runtime takes (its callers word their
    own errors)."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (minimum is None or minimum <= value)
        and (maximum is None or value <= maximum)
    )


def check_whole(name: str, value: object, *, minimum: int = 1, example: str = "") -> int:
    """``value`` as a whole number >= ``minimum``, or the error naming ``name`` (a library
    argument) and an ``example`` of a good value."""
    if not is_whole(value, minimum):
        fix = f"; e.g. {example}" if example else ""
        raise RuntimeConfigError(f"{name} must be a whole number >= {minimum} (got {value!r}){fix}")
    assert isinstance(value, int)  # is_whole said so; for the type checker
    return value


def resolve_plan(
    base: Plan | None,
    method: str | None,
    stages: int | None,
    micro: int | None,
    virtual: int | None,
) -> Plan:
    """The Plan of ``Pipeline``'s arguments: explicit ones over ``base`` over defaults.
    The base's boundaries stay only where its stage layout is kept."""
    if base is not None and not isinstance(base, Plan):
        raise RuntimeConfigError(
            f"plan must be a pipeoptim Plan (got {type(base).__name__}); load one with "
            f"Plan.load('plan.json')"
        )
    if method is not None and not isinstance(method, str):
        raise RuntimeConfigError(
            f"method must be a method's name, e.g. method='pipeoptim' (got "
            f"{type(method).__name__}); see `pipeoptim methods`"
        )
    name = method or (base.method if base else "pipeoptim")
    spec = get_method(name)
    p = stages if stages is not None else (base.num_stages if base else None)
    if p is None:
        raise RuntimeConfigError(
            "Pipeline needs stages=P (the number of pipeline ranks) or plan=Plan.load(...)"
        )
    if not is_whole(p, 1):
        raise RuntimeConfigError(f"stages must be a positive integer (got {p!r})")
    if micro is not None:
        check_whole("micro_batches", micro, example="micro_batches=4 (it must divide the batch)")
    if virtual is not None:
        check_whole("virtual_stages", virtual, example="virtual_stages=2 (interleaved-1f1b)")
    same = base is not None and base.method == name
    if micro is None:
        micro = base.micro_batches if base and same else spec.default_micro_batches_at(p)
    if spec.runs_whole_mini_batches and micro != 1:
        spec.shape(p, micro)  # the registry's error, which names the fix
    if virtual is not None and not spec.places_several_stages_per_rank and virtual != 1:
        spec.shape(p, None, None, virtual)  # the registry's error: one stage per rank
    v = (
        virtual
        if virtual is not None
        else base.virtual_stages
        if base and same
        else spec.default_virtual_stages
    )
    keep = base is not None and base.num_stages == p and base.virtual_stages == v
    return Plan(
        name,
        p,
        micro_batches=micro,
        virtual_stages=v,
        prediction_offset=base.prediction_offset if base else 0,
        optimizer=base.optimizer if base else OptimizerSpec("sgd", 0.02),
        model=base.model if base else None,
        batch_size=base.batch_size if base else None,
        boundaries=base.boundaries if keep and base else None,
        devices=base.devices if base else None,
    )


def check_offset(
    offset: object, method: str, num_stages: int, *, given: bool, flag: str = "prediction_offset"
) -> int:
    """The prediction offset of a run: a whole number of updates added to the derived
    prediction distance s (``plan.versions.prediction_distance``), in 0..P. Below 0 it
    would cut s (down to 0, which is no prediction at all: that is a non-predicting method),
    and past P it predicts further ahead than any stage of a P-stage schedule waits (s is at
    most P-1) while the predictor steps a copy of the LR schedule s times per forward.
    ``given``: passed as an argument (not a plan's value), so a method that does not predict
    refuses it instead of ignoring it. ``flag``: the argument's name in the messages."""
    spec = get_method(method)
    rule = (
        f"it adds updates to the derived prediction distance s (at most P-1 = "
        f"{num_stages - 1} here): 0 is the paper's rule, 1 the reference code's (D - rank)"
    )
    if not is_whole(offset, 0, num_stages):
        raise RuntimeConfigError(
            f"{flag} must be a whole number in 0..{num_stages} (the stage count) "
            f"(got {offset!r}); {rule}"
        )
    if given and offset and not spec.predicts:
        raise RuntimeConfigError(
            f"{flag} {offset} shifts the distance a predicting method predicts ahead, and "
            f"{spec.name} does not predict; use pipeoptim, spectrain or xpipe, or leave "
            f"{flag} out"
        )
    assert isinstance(offset, int)  # is_whole said so; for the type checker
    return offset


def check_replicas(data_parallel: object, transport: str, flag: str = "data_parallel") -> int:
    """``data_parallel`` as a replica count, or the error that says how to fix it (naming
    ``flag``: the library argument or the command-line option)."""
    replicas = plan_replicas(data_parallel, flag, error=RuntimeConfigError)
    if replicas > 1 and ProcessModel.parse(transport).one_process:
        option = "--transport dist" if flag.startswith("--") else "transport='dist'"
        raise RuntimeConfigError(
            f"{flag} {replicas} runs {replicas} replicas of the pipeline as separate "
            f"processes, which needs {option}; the local transport runs one pipeline in this "
            f"process"
        )
    return replicas
