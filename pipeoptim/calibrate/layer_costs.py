"""A measured run's costs shared among its layers: a calibrated per-layer profile that the
planner and the what-if predictions cut at any boundaries."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from pipeoptim.calibrate.fit_costs import profile_meta
from pipeoptim.calibrate.runs import run_boundaries, stage_floats, trace_plan
from pipeoptim.calibrate.trace_costs import costs_from_trace
from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.sim.collectives import Cluster
from pipeoptim.trace import Trace


def _split(total: float, weights: Sequence[float]) -> list[float]:
    """``total`` in proportion to ``weights`` (evenly when they are all 0)."""
    whole = math.fsum(weights)
    if whole <= 0:
        return [total / len(weights)] * len(weights)
    return [total * w / whole for w in weights]


def _split_int(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` bytes in proportion to ``weights``, summing to ``total`` exactly."""
    parts = [int(x) for x in _split(float(total), weights)]
    parts[-1] += total - sum(parts)
    return parts


def calibrated_profile(
    trace: Trace, profile: Profile | None = None, cluster: Cluster | None = None
) -> Profile:
    """The measured run's costs as a per-layer :class:`Profile` for one replica's mini-batch
    (B/D samples of the global batch B; all of it without replicas). Its update times are
    the optimizer step alone: a data-parallel run's modelled all-reduce (on ``cluster``,
    :func:`costs_from_trace`) is left out, for ``simulate --data-parallel D`` to add.

    Each stage's calibrated costs (:func:`costs_from_trace`) are shared among its layers:
    times in proportion to ``profile``'s layer times, bytes, update and prediction times in
    proportion to its parameter bytes (evenly per layer without a profile). The last layer
    of a stage carries the bytes the stage sends, so cutting this profile at the run's
    boundaries gives back the calibrated costs; cut elsewhere (other stage counts), it
    predicts from measured totals. The part of a time that does not shrink with the batch
    is, at the run's micro-batch size, the same fraction as in ``profile`` (which times
    layers at several sizes); without one, times scale in proportion to the batch. A stage
    whose prediction was not measured (a method that does not predict, the last stage)
    gets ``profile``'s prediction times, else its update time as an estimate of one pass
    over its weights; ``meta["predict_estimated"]`` lists them.
    """
    plan = trace_plan(trace)
    costs = costs_from_trace(trace, cluster)
    bounds = run_boundaries(trace)
    num_layers = bounds[-1][1]
    if profile is not None and profile.num_layers != num_layers:
        raise PipeoptimError(
            f"the profile has {profile.num_layers} layers but the measured run's model has "
            f"{num_layers}; pass the profile of the model that ran"
        )
    m = plan.shape(1).micro_batches
    micro = costs.samples_per_micro_batch
    dtype_bytes = profile.dtype_bytes if profile is not None else 4
    measured_prediction = stage_floats(trace.meta.get("predict_s"))
    layers: list[LayerProfile] = []
    estimated: list[int] = []
    last = len(bounds) - 1
    for k, (start, end) in enumerate(bounds):
        span = range(start, end)
        offline = [profile.layers[i] for i in span] if profile is not None else None
        time_share = [x.compute_s for x in offline] if offline else [1.0] * len(span)
        byte_share = [float(x.param_bytes) for x in offline] if offline else [1.0] * len(span)
        # Times of one micro-batch of the run, and their fixed parts, scaled to the batch.
        forward_run = _split(costs.forward_s[k], time_share)
        backward_run = _split(costs.backward_s[k], time_share)
        fixed_f = _fixed_fraction(offline, micro, profile, "forward")
        fixed_b = _fixed_fraction(offline, micro, profile, "backward")
        forward_fixed = [fixed_f * t for t in forward_run]
        backward_fixed = [fixed_b * t for t in backward_run]
        forward = [c + (t - c) * m for t, c in zip(forward_run, forward_fixed, strict=True)]
        backward = [c + (t - c) * m for t, c in zip(backward_run, backward_fixed, strict=True)]
        update = _split(costs.update_s[k], byte_share)
        if k in measured_prediction:
            predict = _split(costs.predict_s[k], byte_share)
        elif offline is not None and any(x.predict_s for x in offline):
            predict = [x.predict_s for x in offline]
        else:
            predict = list(update)
            estimated.append(k)
        params = _split_int(costs.param_bytes[k], byte_share)
        state = _split_int(costs.optimizer_state_bytes[k], byte_share)
        saved = costs.activation_bytes[k] * m
        if k < last and len(span) > 1:  # the last layer's output crosses to the next stage
            sent = costs.send_forward_bytes[k] * m
            activations = [*_split_int(max(saved - sent, 0), [1.0] * (len(span) - 1)), sent]
        elif k < last:
            activations = [max(saved, costs.send_forward_bytes[k] * m)]
        else:
            activations = _split_int(saved, [1.0] * len(span))
        names = [x.name for x in offline] if offline else [f"{i}:layer" for i in span]
        for j in range(len(span)):
            layers.append(
                LayerProfile(
                    name=names[j],
                    forward_s=forward[j],
                    backward_s=backward[j],
                    activation_bytes=activations[j],
                    param_bytes=params[j],
                    optimizer_state_bytes=state[j],
                    param_count=params[j] // dtype_bytes,
                    update_s=update[j],
                    predict_s=predict[j],
                    forward_fixed_s=forward_fixed[j],
                    backward_fixed_s=backward_fixed[j],
                )
            )
    latencies = costs.latency_s
    device = str(trace.meta.get("device", "cpu")).split(" ")[0]
    return Profile(
        layers=tuple(layers),
        batch_size=max(1, round(micro * m)),
        optimizer=costs.optimizer,
        device=device,
        dtype_bytes=dtype_bytes,
        meta={
            "source": "pipeoptim calibrate",
            "model": plan.model,
            "calibrated_from": {
                "method": plan.method,
                "stages": len(bounds),
                "micro_batches": m,
                "data_parallel": costs.data_parallel,
            },
            "link_latency_s": statistics.median(latencies) if latencies else 0.0,
            "predict_estimated": estimated,
            **({"threads": trace.meta["threads"]} if "threads" in trace.meta else {}),
            **profile_meta(costs),
        },
    )


def _fixed_fraction(
    layers: Sequence[LayerProfile] | None, samples: float, profile: Profile | None, part: str
) -> float:
    """The fraction of ``layers``' ``part`` time (forward/backward) that is fixed when they
    run ``samples`` samples, by ``profile``'s fit; 0 without a profile."""
    if not layers or profile is None:
        return 0.0
    index = 0 if part == "forward" else 1
    total = math.fsum(x.time_at(samples, profile.batch_size)[index] for x in layers)
    fixed = math.fsum(getattr(x, f"{part}_fixed_s") for x in layers)
    return min(fixed / total, 1.0) if total > 0 else 0.0
