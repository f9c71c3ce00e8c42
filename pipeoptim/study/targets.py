"""What the study's runs say against a target metric: samples to reach it, the time that
takes on a hardware profile (samples x the simulated time per sample), and the points the
convergence-risk fit of :mod:`pipeoptim.plan.risk` is fitted to.

The time per sample comes from the simulator on a profile: the one given, checked against
the model (:func:`check_profile`), or this machine's (:func:`machine_profile`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.plan.risk import (
    RiskFitPoint,
    join_row,
    parse_row,
    row_label,
    schedule_versions,
    uncorrected_distance,
)
from pipeoptim.study.cells import (
    Cell,
    higher_is_better,
    method_labels,
    row_micro_batches,
    schedule_of,
    synchronous_label,
)
from pipeoptim.study.grid import StudyConfig
from pipeoptim.study.runs import RunRecord, split_label
from pipeoptim.study.variants import family_of

if TYPE_CHECKING:
    from pipeoptim.runtime.profiling.layer_timing import StepTiming

__all__ = [
    "Target",
    "Targets",
    "TimeToTarget",
    "check_profile",
    "correction_gains",
    "gpipe_equivalent_samples",
    "gpipe_finals",
    "kept_profiles",
    "machine_profile",
    "optimizer_profile",
    "pinned_profiles",
    "profile_fingerprint",
    "retimed_predictions",
    "risk_points",
    "row_optimizers",
    "row_seconds_per_sample",
    "samples_to_target",
    "seconds_per_sample_of",
    "simulated_seconds_per_sample",
    "target_at",
    "target_of",
    "time_to_target",
    "twin_labels",
]


Target = float | Mapping[int, float]
"""A metric every run must reach, or one per depth (gpipe's final metric at each P)."""

Targets = Mapping[str, Target]
"""The target of each yardstick row (``"gpipe"``, ``"gpipe (muon)"``): a row is held to
its own optimizer's (:func:`target_of`)."""


def target_of(targets: Targets, label: str) -> Target | None:
    """The target of row ``label``: its yardstick's (gpipe under the row's optimizer), or
    None where the study has no such gpipe row."""
    return targets.get(synchronous_label(label))


def target_at(target: Target, stages: int) -> float:
    """The target of a run of ``stages`` stages."""
    if isinstance(target, Mapping):
        return float(target.get(stages, math.nan))
    return float(target)


def gpipe_finals(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    within: float = 0.0,
    label: str = "gpipe",
) -> dict[int, float]:
    """gpipe's final test metric (mean over seeds) at each depth, at the first optimizer's
    chosen rate, with its test loss raised by ``within`` (a share: 0.03 is the goal at depth,
    3 % over gpipe's final loss): the target of a study that asks "how soon does a method
    get where synchronous training gets". Perplexity targets are ``exp((1 + within)·L)``;
    accuracy targets are gpipe's accuracy less ``within`` of it. ``label``: the gpipe row,
    ``gpipe (muon)`` for the target of the rows trained under Muon."""
    opt = config.optimizers[0]
    out: dict[int, float] = {}
    perplexity = not higher_is_better(config.model)
    for p in config.stages:
        cell = cells.get((label, opt, rates[opt][0], p))
        if cell is None:
            continue
        if perplexity:
            value = math.exp((1.0 + within) * cell.final_test_loss)
        else:
            mean, _ = cell.stat(lambda r: r.final.test_metric if r.final else math.nan)
            value = (1.0 - within) * mean
        if math.isfinite(value):
            out[p] = value
    return out


def samples_to_target(record: RunRecord, target: float) -> int | None:
    """Samples seen at the first evaluation that reached ``target`` (None: never)."""
    if not record.curve:
        return None
    better = higher_is_better(record.spec.model)
    for point in record.curve:
        value = point.test_metric
        if math.isfinite(value) and (value >= target if better else value <= target):
            return point.samples
    return None


def simulated_seconds_per_sample(
    profile: Profile, method: str, stages: int, micro_batches: int | None = None
) -> float:
    """Time per sample of ``method`` on ``profile``, the study's even partition, no link
    cost: the simulator's steady state. ``micro_batches``: per update, where not the
    method's default (a dial row's M)."""
    from pipeoptim.plan.methods import get_method
    from pipeoptim.plan.plan import even_boundaries
    from pipeoptim.sim.costs import CostModel
    from pipeoptim.sim.evaluate import compile_method, evaluate_program

    spec = get_method(method)
    m = micro_batches if micro_batches is not None else spec.default_micro_batches_at(stages)
    shape = spec.shape(stages, m, 4 * stages)
    costs = CostModel.from_profile(profile, even_boundaries(profile.num_layers, stages), m)
    result = evaluate_program(compile_method(method, shape), costs)
    return 1.0 / result.steady_throughput


def machine_profile(model: str, batch_size: int, optimizer: str) -> Profile:
    """This machine's profile of ``model``, one thread (the thread a stage of the study
    runs on)."""
    import torch

    from pipeoptim.workloads.profiling import profile_builtin

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_builtin(model, batch_size=batch_size, optimizer=optimizer, repeats=7)
    finally:
        torch.set_num_threads(threads)


def optimizer_profile(profile: Profile, model: str, optimizer: str) -> Profile:
    """``profile`` with each unit's update and prediction time raised by what ``optimizer``
    costs over the profile's own optimizer, both measured on the unit's own parameters on
    this machine (one thread): a row trained under Muon is simulated with its
    Newton–Schulz steps, which a flat buffer (how the profiler times an update) cannot
    show, as Muon orthogonalises matrices only. A predictor that keeps Δ has its per-update
    part in ``prediction_setup_s`` and its per-write part in ``predict_s``."""
    layers = [
        dataclasses.replace(own.added_to(layer, base), optimizer_state_bytes=own.state_bytes)
        for layer, own, base in _unit_timings(profile, model, optimizer)
    ]
    meta = {**profile.meta, "update_times_of": optimizer, "base": profile_fingerprint(profile)}
    return dataclasses.replace(profile, layers=tuple(layers), optimizer=optimizer, meta=meta)


def retimed_predictions(
    made: Profile, profile: Profile, model: str, *, repeats: int = 7
) -> Profile:
    """``made`` (an :func:`optimizer_profile` of ``profile``) with only its prediction
    times measured again, as :func:`optimizer_profile` now splits them (``predict_s`` per
    write, ``prediction_setup_s`` per update); its update times, state bytes and meta
    (so its ``base``) are kept. For optimizer profiles kept from before the split, whose
    ``predict_s`` holds the whole first prediction after a step."""
    optimizer = made.optimizer
    if made.meta.get("base") != profile_fingerprint(profile):
        raise RuntimeConfigError(
            f"the {optimizer} profile was not made from this base profile (its base "
            f"{made.meta.get('base')!r}, the profile's {profile_fingerprint(profile)!r}); "
            f"pass the profile.json it was made from"
        )
    layers = []
    for kept, (layer, own, base) in zip(
        made.layers, _unit_timings(profile, model, optimizer, repeats), strict=True
    ):
        raised = own.added_to(layer, base)
        layers.append(
            dataclasses.replace(
                kept,
                predict_s=raised.predict_s,
                prediction_setup_s=raised.prediction_setup_s,
            )
        )
    return dataclasses.replace(made, layers=tuple(layers))


def _unit_timings(
    profile: Profile, model: str, optimizer: str, repeats: int = 7
) -> list[tuple[LayerProfile, StepTiming, StepTiming]]:
    """Per unit of ``model``: its layer in ``profile``, and its step and prediction timed
    under ``optimizer`` and under the profile's own, on this machine with one thread."""
    import torch

    from pipeoptim.plan.plan import OptimizerSpec
    from pipeoptim.runtime.profiling.layer_timing import time_step_and_prediction, timer_for
    from pipeoptim.workloads.loader import build_model

    check_profile(profile, model)
    units, _ = build_model(model, 0)
    timer = timer_for(torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def times(params: list[torch.nn.Parameter], family: str) -> StepTiming:
        return time_step_and_prediction(
            params, OptimizerSpec(family, 1e-3), warmup=2, repeats=repeats, timer=timer
        )

    try:
        out = []
        for layer, unit in zip(profile.layers, units, strict=True):
            params = list(unit.parameters())
            out.append((layer, times(params, optimizer), times(params, profile.optimizer)))
    finally:
        torch.set_num_threads(threads)
    return out


def row_optimizers(config: StudyConfig) -> list[str]:
    """The optimizers the rows of ``config`` name (the pairs', the dial's and the
    extrapolation rows'), in order: each needs a profile at its own update cost."""
    named = [
        *(o for _, o in config.pairs),
        *config.dial,
        *(o for _, o, _ in (*config.extrapolations, *config.extrapolations_every_depth)),
    ]
    # a family's settings (nadam β1=0.99) leave its update's cost as it is
    return list(dict.fromkeys(family_of(o) for o in named))


def pinned_profiles(
    out_dir: Path, config: StudyConfig, given: Profile | None = None
) -> tuple[Profile, dict[str, Profile]]:
    """The hardware the study's times are simulated on, and the profile of each optimizer
    its rows train besides (:func:`row_optimizers`). ``given``: a profile of the model (then
    every row is simulated on it). Else this machine's, taken once and kept beside the runs
    (``out_dir/profile.json``), so redrawing the report gives the same times; and per other
    optimizer, that profile at the optimizer's own update cost (:func:`optimizer_profile`),
    measured here once and kept as ``out_dir/profile-<optimizer>.json`` (taken again when
    the base profile is)."""
    if given is not None:
        check_profile(given, config.model)
        return given, {}
    pinned = out_dir / "profile.json"
    if not pinned.exists():
        machine_profile(config.model, config.batch_size, config.optimizers[0]).save(pinned)
    chosen = Profile.load(pinned)
    trained_profiles = {}
    for trained in row_optimizers(config):
        if trained == chosen.optimizer:
            continue
        kept = out_dir / f"profile-{trained}.json"
        made = Profile.load(kept) if kept.exists() else None
        if made is None or made.meta.get("base") != profile_fingerprint(chosen):
            # none yet, or made from a profile taken since; read back as it is kept
            optimizer_profile(chosen, config.model, trained).save(kept)
            made = Profile.load(kept)
        trained_profiles[trained] = made
    return chosen, trained_profiles


def kept_profiles(out_dir: Path, config: StudyConfig) -> tuple[Profile, dict[str, Profile]] | None:
    """The profiles :func:`pinned_profiles` keeps under ``out_dir``, read as they are:
    nothing measured, nothing rewritten (None where the base profile is not on file; an
    optimizer without its file is simulated on the base). What the study's risk part reads
    without the report: after a report they are the profiles it simulated on."""
    pinned = out_dir / "profile.json"
    if not pinned.exists():
        return None
    chosen = Profile.load(pinned)
    trained = {
        o: Profile.load(out_dir / f"profile-{o}.json")
        for o in row_optimizers(config)
        if o != chosen.optimizer and (out_dir / f"profile-{o}.json").exists()
    }
    return chosen, trained


def profile_fingerprint(profile: Profile) -> str:
    """A digest of ``profile``'s layers and batch: an :func:`optimizer_profile` made from
    another base (the profile taken again) is stale."""
    import hashlib
    import json

    # a field the profile format gained since (None where not measured, as saved_bytes)
    # leaves the digest of an older profile as it was
    layers = [
        {key: value for key, value in dataclasses.asdict(layer).items() if value is not None}
        for layer in profile.layers
    ]
    text = json.dumps([profile.batch_size, profile.optimizer, layers], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_profile(profile: Profile, model: str) -> None:
    """Refuse a hardware profile taken of another model (another layer count)."""
    from pipeoptim.workloads.loader import build_model

    layers = len(build_model(model, 0)[0])
    if profile.num_layers != layers:
        raise RuntimeConfigError(
            f"the profile for {model} has {profile.num_layers} layers but the model has "
            f"{layers}; profile the same model (pipeoptim profile --model {model} --out FILE "
            f"on the target hardware)"
        )


@dataclass(frozen=True)
class TimeToTarget:
    method: str
    optimizer: str
    stages: int
    reached: int
    seeds: int
    samples: float
    """Median samples to the target over the seeds that reached it (nan: none did)."""
    seconds_per_sample: float

    @property
    def seconds(self) -> float:
        return self.samples * self.seconds_per_sample


def twin_labels(config: StudyConfig) -> dict[str, str]:
    """Each twin row (``zb-h1``, and ``zb-h1 (muon)`` where gpipe trained under Muon) and the
    gpipe row whose updates it makes exactly."""
    syncs = ["gpipe", *(join_row("gpipe", o) for m, o in config.pairs if m == "gpipe")]
    return {synchronous_label(s, twin): s for s in syncs for twin in config.twins}


def row_seconds_per_sample(
    label: str,
    optimizer: str,
    stages: int,
    profile: Profile,
    trained_profiles: Mapping[str, Profile] | None = None,
    cache: dict[tuple[str, int, int, str], float] | None = None,
) -> float:
    """Simulated time per sample of row ``label`` (its method, at its micro-batches) at
    ``stages``, on ``trained_profiles[the optimizer it trains]`` where one is given, else on
    ``profile``; ``optimizer``: the column's (a row that names none trains it). ``cache``
    keeps each simulation for the next row of the same schedule."""
    base = schedule_of(label)
    trained = family_of(split_label(label)[1] or optimizer)
    on = (trained_profiles or {}).get(trained, profile)
    m = row_micro_batches(label, stages)
    key = (base, stages, m, trained if on is not profile else "")
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = simulated_seconds_per_sample(on, base, stages, m)
    return cache[key]


def seconds_per_sample_of(
    config: StudyConfig, profile: Profile, trained_profiles: Mapping[str, Profile] | None = None
) -> Callable[[str, int], float]:
    """Row label and depth -> the row's simulated time per sample in ``config``'s first
    optimizer's column (:func:`row_seconds_per_sample`), each simulation done once."""
    cache: dict[tuple[str, int, int, str], float] = {}
    first = config.optimizers[0]

    def per_sample(label: str, stages: int) -> float:
        return row_seconds_per_sample(label, first, stages, profile, trained_profiles, cache)

    return per_sample


def time_to_target(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    targets: Targets,
    profile: Profile,
    trained_profiles: Mapping[str, Profile] | None = None,
) -> list[TimeToTarget]:
    """Per (optimizer, depth, row): samples to the row's target (its yardstick's:
    :func:`target_of`) times the row's simulated time per sample. A row is simulated on
    ``trained_profiles[the optimizer it trained]`` where one is given (a ``method (muon)``
    row's Muon, else the column's optimizer; :func:`optimizer_profile`), else on
    ``profile``."""
    out = []
    per_sample: dict[tuple[str, int, int, str], float] = {}
    twins = twin_labels(config)
    for opt in config.optimizers:
        lr = rates[opt][0]
        for p in config.stages:
            for method in [*method_labels(config), *twins]:
                # a twin makes gpipe's updates exactly: gpipe's samples, its own time
                cell = cells.get((twins.get(method, method), opt, lr, p))
                target = target_of(targets, method)
                goal = math.nan if target is None else target_at(target, p)
                if cell is None or not math.isfinite(goal):
                    continue  # no yardstick (its gpipe did not train or finish here)
                hits = [samples_to_target(r, goal) for r in cell.records]
                reached = [h for h in hits if h is not None]
                seconds_per_sample = row_seconds_per_sample(
                    method, opt, p, profile, trained_profiles, per_sample
                )
                out.append(
                    TimeToTarget(
                        method,
                        opt,
                        p,
                        len(reached),
                        len(hits),
                        statistics.median(reached) if reached else math.nan,
                        seconds_per_sample,
                    )
                )
    return out


def risk_points(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    targets: Targets,
    closure: Sequence[dict[str, Any]],
) -> list[RiskFitPoint]:
    """(optimizer, uncorrected distance, extra samples to target over gpipe) per cell.

    Against a fixed target a seed that never reaches it counts as the whole run. Against
    gpipe's own final (a per-depth target) that would make every stalled method look as
    fast as gpipe, so there the extra is read off gpipe's curve instead
    (:func:`gpipe_equivalent_samples`): samples gpipe needed for the loss the method ended
    with, against the samples the method spent. A row under another optimizer (``pipeoptim
    (muon)``) is a point of that optimizer, against gpipe under it (``gpipe (muon)``)."""
    points = []
    for opt in config.optimizers:
        lr = rates[opt][0]
        rows = [(m, m, opt, "gpipe") for m in config.methods]
        if opt == config.optimizers[0]:
            rows += [(join_row(m, o), m, o, join_row("gpipe", o)) for m, o in config.pairs]
        for p in config.stages:
            # the dial's rows are points of their optimizer at the delay of their M
            dial = (
                [
                    (
                        row_label(config.dial_method, config.trained_as(o), micro_batches=m),
                        config.dial_method,
                        o,
                        join_row("gpipe", config.trained_as(o)),
                    )
                    for o in config.dial
                    for m in config.dial_counts(p)
                ]
                if opt == config.optimizers[0]
                else []
            )
            for label, method, trained, sync in [*rows, *dial]:
                base = cells.get((sync, opt, lr, p))
                cell = cells.get((label, opt, lr, p))
                target = targets.get(sync)
                if base is None or cell is None or get_method(method).correction:
                    continue  # κ is the plain methods' (a correction has its own gain)
                if target is None:
                    continue
                goal = target_at(target, p)
                base_hits = [samples_to_target(r, goal) for r in base.records]
                if any(h is None for h in base_hits):
                    continue
                reference = statistics.median([h for h in base_hits if h is not None])
                measured = {
                    r["stage"]: r["closed"]
                    for r in closure
                    if (r["method"], r["optimizer"], r["lr"], r["stages"])
                    == (label, trained, lr, p)
                }
                worst = cell.records[0].spec.steps * config.batch_size
                if isinstance(target, Mapping):
                    extra = (
                        statistics.median(
                            worst / gpipe_equivalent_samples(base, r) - 1.0 for r in cell.finished
                        )
                        if cell.finished
                        else math.inf
                    )
                else:
                    hits = [samples_to_target(r, goal) for r in cell.records]
                    # a seed that never reached the target counts as the whole run
                    samples = statistics.median([worst if h is None else h for h in hits])
                    extra = samples / reference - 1.0
                points.append(
                    RiskFitPoint(
                        config.model,
                        method,
                        trained,
                        p,
                        _measured_distance(
                            method, trained, p, measured, parse_row(label).micro_batches
                        ),
                        extra,
                    )
                )
    return points


def gpipe_equivalent_samples(gpipe: Cell, record: RunRecord) -> float:
    """The samples gpipe's curve (its first seed) needed to reach the test loss ``record``
    ended with, interpolated linearly between evaluations. A loss gpipe had by its first
    evaluation counts that evaluation's samples, one below gpipe's final counts gpipe's
    whole run: the extra is then a bound, not a measurement (both ends of the curve)."""
    final = record.final
    curve = gpipe.finished[0].curve if gpipe.finished else []
    if final is None or not curve:
        return math.nan
    loss = final.test_loss
    previous = (0, math.inf)
    for point in curve:
        if point.test_loss <= loss:
            s0, l0 = previous
            if not math.isfinite(l0):
                return float(point.samples)
            share = (l0 - loss) / (l0 - point.test_loss) if l0 > point.test_loss else 1.0
            return s0 + share * (point.samples - s0)
        previous = (point.samples, point.test_loss)
    return float(curve[-1].samples)


def _measured_distance(
    method: str,
    optimizer: str,
    stages: int,
    closed: dict[int, float],
    micro_batches: int | None = None,
) -> float:
    """e at the stage where it is largest, from the closure measured in this cell alone (so
    the fit never reads the constants it produces), at the row's ``micro_batches`` (None:
    its method's default M). A predicting method's stages without a measurement hold no
    weights (a lone ReLU) or never predict (s = 0): nothing is stale."""
    distances, staleness = schedule_versions(method, stages, micro_batches)
    predicting = get_method(method).predicts
    spec = get_method(method)
    values = [
        uncorrected_distance(
            method, optimizer, s, old, closed.get(k, 0.0), spec.accumulation(k, stages)
        )
        for k, (s, old) in enumerate(zip(distances, staleness, strict=True))
        if not predicting or k in closed
    ]
    return max(values, default=0.0)


def correction_gains(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
) -> list[dict[str, Any]]:
    """Per corrected row and depth: the share of its base method's excess final test loss
    over gpipe's that the correction removed, ``1 − (L − L_gpipe) / (L_base − L_gpipe)``
    (1: all of it, 0: none, < 0: worse). The base is the method it corrects, under the same
    optimizer: a row under another optimizer (``pipeoptim+nesterov (muon)``) is measured
    against that optimizer's base and gpipe rows (``pipeoptim (muon)``, ``gpipe (muon)``)
    where the study trained both at every depth the row trained, so the gain is the
    correction's alone (the planner's κ already has the optimizer's); else against the
    first optimizer's at every depth, counting the change of optimizer with it. Either way
    it is keyed by the row's optimizer. Depths where the base is within 1 % of its gpipe
    have nothing to remove and give no row."""
    opt = config.optimizers[0]
    lr = rates[opt][0]
    out: list[dict[str, Any]] = []

    def loss(cell: Cell | None) -> float:
        return math.nan if cell is None else cell.final_test_loss

    # of a λ scan, the λ carried to every depth is the one whose gain counts
    carried = {
        row_label(m, config.trained_as(o), extrapolation=lam)
        for m, o, lam in config.extrapolations_every_depth
    }
    for label in method_labels(config):
        method = get_method(schedule_of(label))
        if method.correction is None:
            continue
        if parse_row(label).extrapolation is not None and label not in carried:
            continue
        trained = split_label(label)[1] or opt
        # one reference for the row at every depth, so its gains average like with like:
        # its optimizer's rows where the study trained them wherever the row trained
        references = (method.schedule_family, "gpipe")
        own = trained != opt and all(
            (f"{m} ({trained})", opt, lr, p) in cells
            for p in config.stages
            if (label, opt, lr, p) in cells
            for m in references
        )
        for p in config.stages:
            mine = loss(cells.get((label, opt, lr, p)))
            base, sync = (
                loss(cells.get((f"{m} ({trained})" if own else m, opt, lr, p))) for m in references
            )
            if not all(math.isfinite(v) for v in (mine, base, sync)) or base < 1.01 * sync:
                continue
            distances, staleness = schedule_versions(
                schedule_of(label), p, row_micro_batches(label, p)
            )
            out.append(
                {
                    "model": config.model,
                    "method": label,
                    "correction": method.correction,
                    "optimizer": trained,
                    "stages": p,
                    "gain": 1.0 - (mine - sync) / (base - sync),
                    # the longest delay the gain was measured at (stage 0's)
                    "delay": max(distances[0], staleness[0]),
                }
            )
    return out
