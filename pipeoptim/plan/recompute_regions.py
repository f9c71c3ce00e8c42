"""Which units of a stage to recompute so that it keeps the least, priced as the runtime runs
them: each run of consecutive recomputed units is one region that keeps only its first unit's
input (``runtime/stage/recompute.py``, the sums of :mod:`pipeoptim.plan.recompute_costs`).

Why not per unit: alone, a ReLU or a Flatten keeps as much as it takes in, so it never looks
worth recomputing; in one region with the layer before it, it frees its whole output. The
cheapest set is found by a dynamic programme over the stage's units with two states (the
previous unit recomputed or not). Per slot, a unit ``l`` left alone keeps ``a_l``; recomputed,
it holds ``w_l`` (its weights, where the recomputation holds Ŵ) and, where it opens a region,
``x_l``; a stage whose last unit is left alone keeps its output ``o`` too. Among equally
small sets the one with the fewest forward seconds again wins, and a unit that frees nothing
is left alone.

:func:`least_kept_band` prices every stage the partitioner may try at once (one numpy step
per stage length); :func:`least_kept_units` gives the set for one stage.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pipeoptim.plan.recompute_costs import UnitCosts

__all__ = ["least_kept_band", "least_kept_units"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def _per_unit(units: UnitCosts, hold: bool) -> tuple[IntArray, IntArray, IntArray, FloatArray]:
    kept = np.asarray(units.activation_bytes, dtype=np.int64)
    entry = np.asarray(units.input_bytes, dtype=np.int64)
    held = np.asarray(units.param_bytes, dtype=np.int64) * (1 if hold else 0)
    seconds = np.asarray(units.forward_s, dtype=np.float64)
    return kept, entry, held, seconds


def _lesser(
    b1: IntArray, t1: FloatArray, b2: IntArray, t2: FloatArray
) -> tuple[npt.NDArray[np.bool_], IntArray, FloatArray]:
    """Where (b1, t1) is no worse than (b2, t2) (bytes first, then seconds), and the lesser."""
    first = (b1 < b2) | ((b1 == b2) & (t1 <= t2))
    return first, np.where(first, b1, b2), np.where(first, t1, t2)


def least_kept_band(units: UnitCosts, hold: bool, width: int) -> tuple[IntArray, FloatArray]:
    """``(bytes, seconds)``, each ``L × width``: entry ``[i, d]`` is the least a stage of units
    ``[i, i + d + 1)`` keeps per slot with the best recomputation (activations and held
    weights) and the forward seconds that recomputation adds; 0 past the last unit."""
    kept, entry, held, seconds = _per_unit(units, hold)
    n = len(kept)
    output = np.asarray([units.output_kept(u) for u in range(n)], dtype=np.int64)
    band_b = np.zeros((n, width), dtype=np.int64)
    band_t = np.zeros((n, width), dtype=np.float64)
    starts = np.arange(n)
    # the stage [i, i + d] ending with its last unit left alone / recomputed
    alone_b, alone_t = kept.copy(), np.zeros(n)
    rec_b, rec_t = entry + held, seconds.copy()
    for d in range(width):
        if d > 0:
            last = np.minimum(starts + d, n - 1)
            _, best_b, best_t = _lesser(alone_b, alone_t, rec_b, rec_t)
            opens_b, opens_t = alone_b + entry[last], alone_t
            _, joined_b, joined_t = _lesser(rec_b, rec_t, opens_b, opens_t)
            alone_b, alone_t = best_b + kept[last], best_t
            rec_b, rec_t = joined_b + held[last], joined_t + seconds[last]
        last = np.minimum(starts + d, n - 1)
        _, b, t = _lesser(alone_b + output[last], alone_t, rec_b, rec_t)
        inside = starts + d < n
        band_b[:, d] = np.where(inside, b, 0)
        band_t[:, d] = np.where(inside, t, 0.0)
    return band_b, band_t


def least_kept_units(units: UnitCosts, start: int, end: int, hold: bool) -> frozenset[int]:
    """The stage-local units of a stage of units ``[start, end)`` whose recomputation makes it
    keep the least (the module's programme, the same ties as :func:`least_kept_band`)."""
    kept, entry, held, seconds = _per_unit(units, hold)
    # per unit: (bytes, seconds, recomputed before?) of the best prefix ending alone / recomputed
    alone: list[tuple[int, float, bool]] = [(int(kept[start]), 0.0, False)]
    rec: list[tuple[int, float, bool]] = [
        (int(entry[start] + held[start]), float(seconds[start]), False)
    ]
    for u in range(start + 1, end):
        (ab, at, _), (rb, rt, _) = alone[-1], rec[-1]
        prev_rec = not _no_worse(ab, at, rb, rt)
        bb, bt = (rb, rt) if prev_rec else (ab, at)
        alone.append((bb + int(kept[u]), bt, prev_rec))
        ob, ot = ab + int(entry[u]), at
        stays = _no_worse(rb, rt, ob, ot)
        jb, jt = (rb, rt) if stays else (ob, ot)
        rec.append((jb + int(held[u]), jt + float(seconds[u]), stays))
    chosen: set[int] = set()
    (ab, at, _), (rb, rt, _) = alone[-1], rec[-1]
    ab += units.output_kept(end - 1)  # a last unit left alone keeps its output
    recomputed = not _no_worse(ab, at, rb, rt)
    for u in range(end - 1, start - 1, -1):
        i = u - start
        if recomputed:
            chosen.add(i)
            recomputed = rec[i][2]
        else:
            recomputed = alone[i][2]
    return frozenset(chosen)


def _no_worse(b1: int, t1: float, b2: int, t2: float) -> bool:
    return b1 < b2 or (b1 == b2 and t1 <= t2)
