"""The model's costs where P ranks take turns on this host's cores: a short run of the
model in that layout, calibrated.

Why not the layers timed in a loop and one slowdown: where the ranks outnumber the cores,
an action that follows a wait costs about 100 to 230 µs more than in a loop, whatever its
size (the calibration's fitted work per action, digits MLP, 4 ranks on 2 cores), so small
micro-batch actions slow 3 to 5 times and whole mini-batches 1.6 to 3 times; the one
slowdown a ping-pong measures (1.85 to 3.84 from one profile to the next) put the offline
prediction −35 % to +58 % off, while the costs calibrated from 100 mini-batches of the
synchronous rival's real run predicted pipeoptim within −21 % to +9 % (docs/demo-report.md).

So where the ranks take turns on the cores, ``pipeoptim profile --ranks P`` trains the
model's units, split evenly into P stages, one process each over gloo, with 1F1B and P
micro-batches, for a few dozen mini-batches (:func:`probe_layout`), and
:func:`adopt_layout` puts what calibration fits from that trace into the profile: each
layer's update time, its forward and backward times with what they cost in the probe
beyond the loop's as a fixed part (:func:`pipeoptim.calibrate.calibrated_profile` shares a
stage's fitted work among its layers by their loop times; the excess is fixed, since it
is mostly an action's cost after a wait), and the fitted work of a message at each end. The
slowdowns then stand at 1 (the layer times hold them), and each weight policy's fixed
cost per action keeps only what it costs beyond the synchronous policy the probe ran
(a split backward's weight half, an action the probe did not run, slowed as the layers).
On a host with a core per rank nothing changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from pipeoptim.calibrate import calibrated_profile
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.plan.runtime_costs import RuntimeCosts
from pipeoptim.trace import Trace
from pipeoptim.workloads.message_probe import PROBE_METHOD, run_probe

__all__ = ["adopt_layout", "probe_layout"]


def probe_layout(
    model: str,
    *,
    stages: int,
    batch_size: int,
    steps: int,
    optimizer: str = "sgd",
    seed: int = 0,
    timeout: float = 180.0,
) -> Trace:
    """The trace of ``model`` trained ``steps`` mini-batches of ``batch_size`` by
    ``stages`` processes of this host (module docstring). Raises ``RuntimeError`` where
    they cannot run it, ``ValueError`` for fewer than 4 steps."""
    return run_probe(
        model,
        stages=stages,
        micro_batches=stages,
        batch_size=batch_size,
        steps=steps,
        optimizer=optimizer,
        seed=seed,
        timeout=timeout,
    )


def _work(layers: Any) -> float:
    return math.fsum(x.forward_s + x.backward_s + x.update_s for x in layers)


def adopt_layout(profile: Profile, trace: Trace) -> Profile:
    """``profile`` (layers timed in a loop, with its ``runtime_costs``) with what the
    probe's ``trace`` measured in the planned layout (module docstring); the profile's
    ``meta["layout_probe"]`` says what ran and the slowdown of its layers' work."""
    runtime = profile.runtime_costs
    if runtime is None:
        raise ValueError("the profile has no runtime costs to take the probe's into")
    calibrated = calibrated_profile(trace, profile)
    slowdown = _work(calibrated.layers) / max(_work(profile.layers), 1e-12)
    probed = profile.batch_size / int(trace.meta.get("micro_batches") or 1)
    layers = tuple(
        dataclasses.replace(
            _excess_fixed(loop, fitted, probed, profile.batch_size),
            update_s=fitted.update_s,
            predict_s=loop.predict_s * slowdown,
            prediction_setup_s=(
                None if loop.prediction_setup_s is None else loop.prediction_setup_s * slowdown
            ),
        )
        for loop, fitted in zip(profile.layers, calibrated.layers, strict=True)
    )
    meta = calibrated.meta
    send = float(meta.get("message_send_s", runtime.message_send_s))
    receive = float(meta.get("message_receive_s", runtime.message_receive_s))
    adopted = RuntimeCosts(
        message_send_s=send,
        message_receive_s=receive,
        message_latency_s=runtime.message_latency_s,
        action_s=_beyond_synchronous(runtime.action_s, slowdown),
    )
    record = {
        "method": PROBE_METHOD,
        "stages": len(trace.meta["boundaries"]),
        "micro_batches": int(trace.meta.get("micro_batches") or 1),
        "mini_batches": int(trace.meta.get("mini_batches") or 0),
        "boundaries": [list(b) for b in trace.meta["boundaries"]],
        "slowdown": slowdown,
        "send_s": send,
        "receive_s": receive,
    }
    return dataclasses.replace(
        profile,
        layers=layers,
        runtime_costs=adopted,
        meta={**profile.meta, "layout_probe": record},
    )


def _excess_fixed(
    loop: LayerProfile, fitted: LayerProfile, probed: float, batch_size: int
) -> LayerProfile:
    """``loop``'s forward and backward with the probe's excess over them as a fixed part:
    equal to ``fitted`` at the probe's micro-batch of ``probed`` samples, and as much more
    per sample as in the loop. The excess is mostly what an action costs after a wait,
    whatever its size (module docstring). Shared in proportion with the per-sample part
    (calibration's own split, by the loop's fixed fraction), it cost pipeoptim's whole
    mini-batches up to M times the excess of the probe's micro-batch: the default demo's
    offline prediction of pipeoptim was −8 % to −18 % off in four runs on a 2-core
    machine, and +4.5, +5.4, 0.0, +2.7 and −9.5 % in five with the excess fixed."""
    loop_f, loop_b = loop.time_at(probed, batch_size)
    fit_f, fit_b = fitted.time_at(probed, batch_size)

    def moved(total: float, fixed: float, excess: float) -> tuple[float, float]:
        new_fixed = max(fixed + excess, 0.0)
        return max(total + excess, new_fixed), new_fixed

    forward, forward_fixed = moved(loop.forward_s, loop.forward_fixed_s, fit_f - loop_f)
    backward, backward_fixed = moved(loop.backward_s, loop.backward_fixed_s, fit_b - loop_b)
    return dataclasses.replace(
        loop,
        forward_s=forward,
        backward_s=backward,
        forward_fixed_s=forward_fixed,
        backward_fixed_s=backward_fixed,
    )


def _beyond_synchronous(
    action_s: Mapping[str, Mapping[str, float]], slowdown: float
) -> dict[str, dict[str, float]]:
    """Each policy's fixed seconds per action beyond the synchronous (``flush``) policy's,
    which the probe's layer times already hold. The excess of an action the probe also ran
    (a stash's or a prediction's bookkeeping in a forward) is work within that action, as
    timed in a loop: the layers' slowdown, mostly the cost of an action after a wait, is
    not its (scaled by it, the offline prediction of pipeoptim came out −11 % to −41 % in
    six demo runs, unscaled −23 % to +16 %). A split backward's input half replaces the
    backward (its excess over it is charged so), but its weight half is one more action,
    which meets what every action meets there: it takes the layers' ``slowdown`` (unslowed,
    zb-h1 was predicted +18 % to +24 % over its real runs in three of four, and ranked over
    1f1b, whose own runs measured faster)."""
    flush = action_s.get("flush", {})
    base = {
        "F": flush.get("F", 0.0),
        "B": flush.get("B", 0.0),
        "U": flush.get("U", 0.0),
        "I": flush.get("B", 0.0),
    }
    return {
        policy: {
            k: v * slowdown if k == "W" else max(0.0, v - base.get(k, 0.0))
            for k, v in kinds.items()
        }
        for policy, kinds in action_s.items()
    }
