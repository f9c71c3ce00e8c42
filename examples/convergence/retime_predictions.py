"""Re-time the prediction of the study's kept optimizer profiles with the per-update split.

    python examples/convergence/retime_predictions.py                   # every kept one
    python examples/convergence/retime_predictions.py --repeats 31 PROFILE.json   # one

Why it exists: a predictor that keeps its direction Δ (Muon's Newton–Schulz, basis rotation's
rotations) now computes it once at the end of each update (``Stage._prepare_deltas``) instead
of inside the next predicted forward, and the profile says so with ``prediction_setup_s``
(per update) beside ``predict_s`` (per write). The ``profile-<optimizer>.json`` files kept
under ``results/`` were made before the split: their ``predict_s`` is the whole first
prediction after a step. Making them again (``optimizer_profile``) would time the updates
again too and move every committed number; this script re-times only the prediction, on
each unit of the study's model as ``optimizer_profile`` builds it (one thread, as the
profiles' ``meta.threads``), and rewrites ``predict_s`` and ``prediction_setup_s``,
leaving the updates, the state bytes and ``meta`` (so the base fingerprint) as they were
(:func:`pipeoptim.study.targets.retimed_predictions`). Optimizers whose predictor keeps no
Δ (NAdam) are left alone.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pipeoptim.plan.profile import Profile
from pipeoptim.study.targets import retimed_predictions

RESULTS = Path(__file__).resolve().parent / "results"
KEEPS_DELTA = ("muon", "basis-rotation")
"""The study's optimizers whose predictor keeps Δ (``keeps_deltas``)."""


def retime(path: Path, repeats: int) -> None:
    made = Profile.load(path)
    base = Profile.load(path.parent / "profile.json")
    model = str(made.meta.get("model") or base.meta["model"])
    new = retimed_predictions(made, base, model, repeats=repeats)
    new.save(path)
    print(f"{path.relative_to(RESULTS.parent)} ({model}, {made.optimizer}):")
    kinds: dict[str, list[tuple[float, float, float]]] = {}
    for old, now in zip(made.layers, new.layers, strict=True):
        kind = old.name.split(":", 1)[-1]
        kinds.setdefault(kind, []).append(
            (old.predict_s, now.predict_s, now.prediction_setup_s or 0.0)
        )
    for kind, rows in kinds.items():
        old_ms, write_ms, setup_ms = (1e3 * statistics.median(c) for c in zip(*rows, strict=True))
        print(
            f"  {kind:14} x{len(rows):<3} predict {old_ms:.3f} ms -> write {write_ms:.3f} ms"
            f" + setup {setup_ms:.3f} ms per update (medians over the units)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("profiles", nargs="*", type=Path, help="default: every kept one")
    parser.add_argument("--repeats", type=int, default=21, help="timed steps per unit")
    args = parser.parse_args()
    paths = args.profiles or sorted(
        p for o in KEEPS_DELTA for p in RESULTS.glob(f"*/profile-{o}.json")
    )
    for path in paths:
        retime(path.resolve(), args.repeats)


if __name__ == "__main__":
    main()
