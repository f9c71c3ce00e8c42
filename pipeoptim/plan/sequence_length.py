"""Planning for a stated maximum sequence length: a profile's costs scaled in tokens.

When batches vary in length (``CommOptions.varying_shapes``: a collate that pads each batch
to its own longest sequence), the pipeline must fit its longest batch, not the one it was
profiled on. A profile is measured at some length (tokens per sample); :func:`at_length`
turns it into the profile of a stated maximum length: each layer's activation bytes and the
per-sample part of its forward and backward times scale linearly with the tokens per
micro-batch (the fixed part of a time does not), so the memory model (activations held per
micro-batch in flight) and the simulator (stage times) both see the longest batch, and the
planner plans for it. Linear on purpose, and simple: attention's term quadratic in the
length is not modelled, so at a maximum much longer than the profile's, profile at that
length instead.

The length a profile was measured at is ``meta["sequence_length"]`` where it says so, else
the second dimension of an integer input of two dimensions (token ids, batch x tokens,
``meta["input_shape"]``, which ``pipeoptim profile`` records).
"""

from __future__ import annotations

from dataclasses import replace

from pipeoptim.errors import PlanError
from pipeoptim.plan.profile import Profile

__all__ = ["LENGTH_KEY", "at_length", "measured_length"]

LENGTH_KEY = "sequence_length"
"""The profile's ``meta`` key of the tokens per sample it was measured at."""

_INTEGER_DTYPES = frozenset(f"torch.{kind}" for kind in ("int64", "int32", "int16", "uint8"))


def measured_length(profile: Profile) -> int | None:
    """Tokens per sample the profile was measured at (None: it does not say)."""
    stated = profile.meta.get(LENGTH_KEY)
    if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 1:
        return stated
    shape, dtype = profile.meta.get("input_shape"), profile.meta.get("input_dtype")
    if isinstance(shape, list) and len(shape) == 2 and dtype in _INTEGER_DTYPES:
        length = shape[1]
        if isinstance(length, int) and length >= 1:
            return length
    return None


def at_length(profile: Profile, max_length: int) -> Profile:
    """``profile`` at ``max_length`` tokens per sample: activation and saved bytes and the
    per-sample part of each time scaled by ``max_length`` over the measured length."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise PlanError(f"the maximum length must be a whole number >= 1 (got {max_length!r})")
    measured = measured_length(profile)
    if measured is None:
        raise PlanError(
            f"the profile does not say the sequence length it was measured at (neither "
            f"meta.{LENGTH_KEY} nor an integer (batch, tokens) input_shape), so it cannot be "
            f'scaled to a maximum length of {max_length}; add "{LENGTH_KEY}": <tokens per '
            f"sample> to the profile's meta, or profile at the maximum length and drop "
            f"--max-length"
        )
    if measured == max_length:
        return profile
    ratio = max_length / measured
    samples = profile.batch_size * ratio  # tokens per micro-batch, in samples of the profile's
    layers = []
    for layer in profile.layers:
        forward, backward = layer.time_at(samples, profile.batch_size)
        layers.append(
            replace(
                layer,
                forward_s=forward,
                backward_s=backward,
                activation_bytes=-(-layer.activation_bytes * max_length // measured),
                saved_bytes=None
                if layer.saved_bytes is None
                else -(-layer.saved_bytes * max_length // measured),
            )
        )
    meta = {**profile.meta, LENGTH_KEY: max_length, "measured_length": measured}
    return replace(profile, layers=tuple(layers), meta=meta)
