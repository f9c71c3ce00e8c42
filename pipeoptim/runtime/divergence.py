"""What a run that diverged tells its user: the step, what was kept, and the remedies.

Apart from the fit loop because the message is the toolkit's advice, not training: it names
the last good checkpoint and, for the asynchronous methods whose stage 0 runs more than one
update behind (whole mini-batches, or PipeOptim's dial at M < P-1), the remedies the
convergence study measured at their depth.
"""

from __future__ import annotations

from pipeoptim.plan.methods import Method
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.versions import steady_delays
from pipeoptim.runtime.options import StageOptions

__all__ = ["nonfinite_message"]


def nonfinite_message(
    value: float,
    step: int,
    *,
    last_checkpoint: int | None,
    checkpoint_dir: str | None,
    method: Method,
    shape: Shape,
    options: StageOptions,
) -> str:
    """The error of a non-finite loss ``value`` at ``step`` of a run whose stages were built
    with ``options`` (the remedies name what the run did not already use)."""
    last, where = last_checkpoint, checkpoint_dir
    if last is not None:
        kept = f"the last good checkpoint (step {last}) in {where} was kept"
    elif where:
        kept = "no checkpoint had been written yet"
    else:
        kept = "nothing was checkpointed (set checkpoint_dir to keep one)"
    resume = " and resume from it (--resume, fit(..., resume=True))" if last is not None else ""
    return (
        f"non-finite loss ({value}) at step {step} (mini-batches count from 0); training "
        f"stopped and {kept}. Lower the learning rate{resume}"
        + _divergence_advice(method, shape, options)
    )


def _divergence_advice(method: Method, shape: Shape, options: StageOptions) -> str:
    """The remedies the convergence study measured, for this method, depth and M: where
    stage 0 runs more than one update behind (the version analysis's delay at this M)."""
    if method.flushes:
        return "."
    s = steady_delays(method, shape).get(0, 0)
    if s <= 1:
        return "."
    more = (
        f", or more micro-batches (--micro-batches {shape.num_stages - 1} or more gives one update)"
        if method.dials_micro_batches
        else ""
    )
    text = (
        f"; {method.name} runs stage 0's forward {s} update(s) ahead of its backward "
        f"(at M = {shape.micro_batches}), and in the convergence study "
        f"(examples/convergence/results) such pipelines at 8 stages lost accuracy or diverged "
        f"under SGD-momentum where gpipe, 2bw and xpipe (s <= 1) did not: use 2bw or xpipe"
        f"{more}, or fewer stages"
    )
    if method.predicts and not options.predicted_backward:
        text += (
            ", or predicted_backward=True (input gradients through the predicted "
            "weights too, one weight copy per mini-batch in flight)"
        )
    return text + "."
