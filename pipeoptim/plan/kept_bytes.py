"""What a stage keeps of each unit's activations for its backward, from the profile: one
rule for the partitioner, the simulator and the plan's stage graph, matching what the
runtime counts (``runtime/stage/saved.py``).

Per micro-batch in flight, a stage of units ``[start, end)`` without recomputation keeps

    Σ_l s_l + o_{end-1}

``s_l``: what unit ``l`` saves other than its output (the profile's ``saved_bytes``: a
Linear's input, a block's attention probabilities); ``o_{end-1}``: the output the stage
holds from its forward to its backward (on the last stage, what the loss saves of it). A
unit's output kept inside the stage is booked by the unit that saves it as its input, or by
the recomputed region that starts there (``plan/recompute_costs.py``).

A profile from before ``saved_bytes`` was measured books each unit's output as what it keeps
(``s_l = activation_bytes``, ``o = 0``), the model of those releases.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeoptim.plan.profile import LayerProfile

__all__ = ["output_kept_bytes", "stage_kept_bytes", "unit_saved_bytes"]


def unit_saved_bytes(layer: LayerProfile) -> int:
    """``s_l``: what the unit saves for its backward other than its output."""
    return layer.activation_bytes if layer.saved_bytes is None else layer.saved_bytes


def output_kept_bytes(layer: LayerProfile) -> int:
    """``o_l``: what a stage ending with this unit keeps of its output (0 where
    :func:`unit_saved_bytes` books the output already)."""
    return 0 if layer.saved_bytes is None else layer.activation_bytes


def stage_kept_bytes(layers: Sequence[LayerProfile]) -> int:
    """What a stage of ``layers`` keeps per micro-batch without recomputation."""
    if not layers:
        return 0
    return sum(unit_saved_bytes(x) for x in layers) + output_kept_bytes(layers[-1])
