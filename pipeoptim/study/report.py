"""The study's results: tables (markdown), curves (plotly), time to accuracy, closure.

* **Final table**: final test metric and final training loss, mean ± std over seeds, per
  method x optimizer x depth (diverged runs counted apart).
* **Curves**: test metric and training loss against samples seen, mean over seeds.
* **Prediction closure**: for pipeoptim, spectrain and xpipe, per stage, the share of the
  stale distance ‖W_f − W_b‖ the prediction removed (1 − median of ‖Ŵ − W_b‖/‖W_f − W_b‖).
* **Time to accuracy**: samples a method needs to reach the model's target metric (from
  its curves) x the simulated time per sample of that method, stages and partition on a
  profiled device (by default this machine, one thread per stage).
* **Risk fit**: the convergence-risk coefficients of ``pipeoptim.plan.risk`` fitted to the
  measured samples-to-target (``risk_fit.json``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import WeightPolicy, get_method
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.risk import (
    RiskFitPoint,
    closure_from_rows,
    fit_risk,
    schedule_versions,
    uncorrected_distance,
)
from pipeoptim.study.grid import (
    StudyConfig,
    choose_rates,
    load_records,
    main_specs,
    sweep_specs,
)
from pipeoptim.study.runs import MODEL_METRIC, RunRecord

__all__ = [
    "TARGETS",
    "Cell",
    "aggregate",
    "check_profile",
    "samples_to_target",
    "write_study_report",
]

TARGETS: dict[str, float] = {"mlp": 0.95, "cnn": 0.95, "transformer": 0.95, "gpt": 12.0}
"""The metric a run must reach to count as trained: test accuracy for the digits models,
test perplexity (at most) for the language model."""


@dataclass(frozen=True)
class Cell:
    """Every seed of one (method, optimizer, lr, stages)."""

    method: str
    optimizer: str
    lr: float
    stages: int
    records: tuple[RunRecord, ...]

    @property
    def finished(self) -> list[RunRecord]:
        return [r for r in self.records if r.diverged_at is None and r.final is not None]

    @property
    def diverged(self) -> int:
        return len(self.records) - len(self.finished)

    def stat(self, pick: Callable[[RunRecord], float]) -> tuple[float, float]:
        """Mean and (sample) standard deviation over the finished seeds."""
        values = [pick(r) for r in self.finished]
        values = [v for v in values if math.isfinite(v)]
        if not values:
            return math.nan, math.nan
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def aggregate(records: Iterable[RunRecord]) -> dict[tuple[str, str, float, int], Cell]:
    groups: dict[tuple[str, str, float, int], list[RunRecord]] = defaultdict(list)
    for r in records:
        s = r.spec
        groups[(s.label, s.optimizer, s.lr, s.stages)].append(r)
    return {k: Cell(*k, tuple(sorted(v, key=lambda r: r.spec.seed))) for k, v in groups.items()}


def _higher_is_better(model: str) -> bool:
    return MODEL_METRIC[model] == "accuracy"


def samples_to_target(record: RunRecord, target: float) -> int | None:
    """Samples seen at the first evaluation that reached ``target`` (None: never)."""
    if not record.curve:
        return None
    better = _higher_is_better(record.spec.model)
    for point in record.curve:
        value = point.test_metric
        if math.isfinite(value) and (value >= target if better else value <= target):
            return point.samples
    return None


def _fmt_metric(model: str, mean: float, std: float) -> str:
    """``97.1 ± 0.4`` (accuracy in %) or ``9.87 ± 0.12``; no ± for a single seed."""
    if not math.isfinite(mean):
        return "—"
    scale, digits = (100, 1) if _higher_is_better(model) else (1, 2)
    spread = f" ± {scale * std:.{digits}f}" if math.isfinite(std) else ""
    return f"{scale * mean:.{digits}f}{spread}"


def _fmt_loss(mean: float, std: float) -> str:
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.3g}" + (f" ± {std:.2g}" if math.isfinite(std) else "")


def _final_metric(r: RunRecord) -> float:
    return r.final.test_metric if r.final else math.nan


def _final_loss(r: RunRecord) -> float:
    return r.final.train_loss if r.final else math.nan


def rate_sets(
    config: StudyConfig, rates: dict[str, tuple[float, float | None]]
) -> list[tuple[str, dict[str, float]]]:
    """The learning rates every method trained at, as (title, optimizer -> lr)."""
    sets = [("chosen rate", {o: rates[o][0] for o in config.optimizers})]
    if config.high_rate:
        high = {o: h for o in config.optimizers if (h := rates[o][1]) is not None}
        if high:
            sets.append(("higher rate", high))
    for opt, extra in config.extra_rates.items():
        for lr in extra:
            sets.append((f"{opt} lr={lr:g}", {opt: lr}))
    return sets


def final_table(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    lr_of: dict[str, float],
) -> list[str]:
    """Markdown rows: one per method, a column per (optimizer, depth)."""
    metric = "test accuracy %" if _higher_is_better(config.model) else "test perplexity"
    columns = [
        (opt, lr_of[opt], p) for opt in config.optimizers if opt in lr_of for p in config.stages
    ]
    if not columns:
        return []
    head = "| method | " + " | ".join(f"{o} lr={lr:g} P={p}" for o, lr, p in columns) + " |"
    lines = [
        f"{metric} / final training loss (mean ± std over seeds; ✗k: k seeds diverged)",
        "",
        head,
        "|---|" + "---|" * len(columns),
    ]
    for method in _labels(config):
        row = []
        for opt, lr, p in columns:
            assert lr is not None
            cell = cells.get((method, opt, lr, p))
            if cell is None:
                row.append("not run")
                continue
            text = (
                f"{_fmt_metric(config.model, *cell.stat(_final_metric))} / "
                f"{_fmt_loss(*cell.stat(_final_loss))}"
            )
            if cell.diverged:
                text += f" ✗{cell.diverged}"
            row.append(text)
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return lines


def _steps_text(config: StudyConfig) -> str:
    longer = {o: n for o, n in config.steps_by_optimizer.items() if o in config.optimizers}
    if not longer:
        return str(config.steps)
    return f"{config.steps} ({', '.join(f'{o}: {n}' for o, n in longer.items())})"


def _labels(config: StudyConfig) -> list[str]:
    """Table rows: every method, then the predicted-backward variants."""
    return [*config.methods, *(f"{m}+Ŵbackward" for m in config.variants)]


def closure_rows(records: Iterable[RunRecord]) -> list[dict[str, Any]]:
    """One row per (model, method, optimizer, lr, stages, stage) with closure samples."""
    rows = []
    for r in records:
        for st in r.closure:
            rows.append(
                {
                    "model": r.spec.model,
                    "method": r.spec.label,
                    "optimizer": r.spec.optimizer,
                    "lr": r.spec.lr,
                    "stages": r.spec.stages,
                    "stage": st["stage"],
                    "s": st["max_distance"],
                    "closed": 1.0 - st["median_ratio"],
                    "samples": st["samples"],
                }
            )
    return rows


def closure_table(rows: Sequence[dict[str, Any]], lr_of: dict[str, float]) -> list[str]:
    """Markdown: share of the stale distance removed, per stage (s in brackets)."""
    picked = [r for r in rows if r["lr"] == lr_of.get(r["optimizer"])]
    if not picked:
        return []
    width = max(r["stages"] for r in picked)
    lines = [
        "| method | optimizer | P | " + " | ".join(f"stage {k}" for k in range(width)) + " |",
        "|---|---|---|" + "---|" * width,
    ]
    keys = sorted({(r["method"], r["optimizer"], r["stages"]) for r in picked})
    for method, opt, p in keys:
        by_stage = {
            r["stage"]: r
            for r in picked
            if (r["method"], r["optimizer"], r["stages"]) == (method, opt, p)
        }
        cells = [
            f"{100 * by_stage[k]['closed']:.0f}% (s={by_stage[k]['s']})" if k in by_stage else ""
            for k in range(width)
        ]
        lines.append(f"| {method} | {opt} | {p} | " + " | ".join(cells) + " |")
    return lines


def simulated_seconds_per_sample(profile: Profile, method: str, stages: int) -> float:
    """Time per sample of ``method`` on ``profile``, the study's even partition, no link
    cost: the simulator's steady state."""
    from pipeoptim.plan.methods import get_method
    from pipeoptim.plan.plan import even_boundaries
    from pipeoptim.sim.costs import CostModel
    from pipeoptim.sim.evaluate import compile_method, evaluate_program

    spec = get_method(method)
    m = stages if spec.micro_batched else 1
    shape = spec.shape(stages, m, 4 * stages)
    costs = CostModel.from_profile(profile, even_boundaries(profile.num_layers, stages), m)
    result = evaluate_program(compile_method(method, shape), costs)
    return 1.0 / result.steady_throughput


def machine_profile(model: str, batch_size: int, optimizer: str) -> Profile:
    """This machine's profile of ``model``, one thread (the thread a stage of the study
    runs on)."""
    import torch

    from pipeoptim.runtime.profiler import profile_builtin

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_builtin(model, batch_size=batch_size, optimizer=optimizer, repeats=7)
    finally:
        torch.set_num_threads(threads)


def check_profile(profile: Profile, model: str) -> None:
    """Refuse a hardware profile taken of another model (another layer count)."""
    from pipeoptim.runtime.models import build_model

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


def time_to_target(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    target: float,
    profile: Profile,
) -> list[TimeToTarget]:
    out = []
    per_sample: dict[tuple[str, int], float] = {}  # the same for every optimizer
    for opt in config.optimizers:
        lr = rates[opt][0]
        for p in config.stages:
            for method in _labels(config):
                cell = cells.get((method, opt, lr, p))
                if cell is None:
                    continue
                hits = [samples_to_target(r, target) for r in cell.records]
                reached = [h for h in hits if h is not None]
                base = method.split("+")[0]  # a variant runs its method's schedule
                if (base, p) not in per_sample:
                    per_sample[(base, p)] = simulated_seconds_per_sample(profile, base, p)
                out.append(
                    TimeToTarget(
                        method,
                        opt,
                        p,
                        len(reached),
                        len(hits),
                        statistics.median(reached) if reached else math.nan,
                        per_sample[(base, p)],
                    )
                )
    return out


def time_table(config: StudyConfig, rows: Sequence[TimeToTarget], target: float) -> list[str]:
    what = (
        f"{100 * target:.0f}% test accuracy"
        if _higher_is_better(config.model)
        else (f"test perplexity {target:g}")
    )
    lines = [
        f"Target: {what}. Samples: median over the seeds that reached it (evaluated once "
        f"per {config.eval_every} mini-batches). Time: samples x the simulated time per "
        f"sample of the method, depth and even partition on the hardware below (no link "
        f"cost; micro-batches cost 1/M of the mini-batch).",
        "",
        "| optimizer | P | method | reached | samples to target | simulated samples/s | "
        "predicted time to target (ms) | vs gpipe |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gpipe = {(r.optimizer, r.stages): r.seconds for r in rows if r.method == "gpipe"}
    for r in rows:
        samples = "never" if not math.isfinite(r.samples) else f"{r.samples:,.0f}"
        ms = "—" if not math.isfinite(r.seconds) else f"{1e3 * r.seconds:.3g}"
        base = gpipe.get((r.optimizer, r.stages), math.nan)
        versus = f"{r.seconds / base:.2f}x" if math.isfinite(r.seconds / base) else "—"
        lines.append(
            f"| {r.optimizer} | {r.stages} | {r.method} | {r.reached}/{r.seeds} | {samples} | "
            f"{1 / r.seconds_per_sample:,.0f} | {ms} | {versus} |"
        )
    return lines


def risk_points(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    target: float,
    closure: Sequence[dict[str, Any]],
) -> list[RiskFitPoint]:
    """(optimizer, uncorrected distance, extra samples to target over gpipe) per cell."""
    points = []
    for opt in config.optimizers:
        lr = rates[opt][0]
        for p in config.stages:
            base = cells.get(("gpipe", opt, lr, p))
            if base is None:
                continue
            base_hits = [samples_to_target(r, target) for r in base.records]
            if any(h is None for h in base_hits):
                continue
            reference = statistics.median([h for h in base_hits if h is not None])
            for method in config.methods:
                cell = cells.get((method, opt, lr, p))
                if cell is None:
                    continue
                measured = {
                    r["stage"]: r["closed"]
                    for r in closure
                    if (r["method"], r["optimizer"], r["lr"], r["stages"]) == (method, opt, lr, p)
                }
                hits = [samples_to_target(r, target) for r in cell.records]
                # a seed that never reached the target counts as the whole run
                worst = cell.records[0].spec.steps * config.batch_size
                samples = statistics.median([worst if h is None else h for h in hits])
                points.append(
                    RiskFitPoint(
                        config.model,
                        method,
                        opt,
                        p,
                        _measured_distance(method, opt, p, measured),
                        samples / reference - 1.0,
                    )
                )
    return points


def _measured_distance(method: str, optimizer: str, stages: int, closed: dict[int, float]) -> float:
    """e at the stage where it is largest, from the closure measured in this cell alone (so
    the fit never reads the constants it produces). A predicting method's stages without a
    measurement hold no weights (a lone ReLU) or never predict (s = 0): nothing is stale."""
    distances, staleness = schedule_versions(method, stages, stages)
    predicting = get_method(method).weight_policy is WeightPolicy.PREDICT
    values = [
        uncorrected_distance(method, optimizer, s, old, closed.get(k, 0.0))
        for k, (s, old) in enumerate(zip(distances, staleness, strict=True))
        if not predicting or k in closed
    ]
    return max(values, default=0.0)


def _curves_figures(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
) -> list[Any]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figs = []
    metric = "test accuracy" if _higher_is_better(config.model) else "test perplexity"
    for label, lr_of in rate_sets(config, rates):
        columns = [(o, lr_of[o]) for o in config.optimizers if o in lr_of]
        for quantity in (metric, "training loss"):
            titles = [f"{o} lr={lr:g}, P={p}" for p in config.stages for o, lr in columns]
            fig = make_subplots(
                rows=len(config.stages),
                cols=len(columns),
                subplot_titles=titles,
                shared_xaxes=True,
            )
            for i, p in enumerate(config.stages):
                for j, (opt, lr) in enumerate(columns):
                    for n, method in enumerate(_labels(config)):
                        cell = cells.get((method, opt, lr, p))
                        if cell is None or not cell.records:
                            continue
                        xs, ys = _mean_curve(cell, quantity != "training loss")
                        fig.add_trace(
                            go.Scatter(
                                x=xs,
                                y=ys,
                                name=method,
                                legendgroup=method,
                                showlegend=i == 0 and j == 0,
                                mode="lines",
                                line={"color": _COLORS[n % len(_COLORS)]},
                            ),
                            row=i + 1,
                            col=j + 1,
                        )
            if quantity == "training loss":
                fig.update_yaxes(type="log")
            fig.update_xaxes(title_text="samples seen", row=len(config.stages))
            fig.update_layout(
                title=f"{config.model}: {quantity} ({label}, mean over seeds)",
                height=320 * len(config.stages),
                width=420 * len(columns),
            )
            figs.append(fig)
    return figs


_COLORS = [
    "#1f77b4",
    "#aec7e8",
    "#d62728",
    "#9467bd",
    "#ff7f0e",
    "#8c564b",
    "#2ca02c",
    "#17becf",
]


def _mean_curve(cell: Cell, test: bool) -> tuple[list[int], list[float]]:
    """Mean over seeds at each evaluation all seeds reached (a diverged seed ends early)."""
    curves = [r.curve for r in cell.records]
    n = min(len(c) for c in curves)
    xs = [curves[0][i].samples for i in range(n)]
    ys = [
        statistics.fmean(c[i].test_metric if test else c[i].train_loss for c in curves)
        for i in range(n)
    ]
    return xs, ys


def _time_figure(model: str, rows: Sequence[TimeToTarget]) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    groups = sorted({(r.optimizer, r.stages) for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows))
    for n, method in enumerate(methods):
        mine = {(r.optimizer, r.stages): r for r in rows if r.method == method}
        fig.add_trace(
            go.Bar(
                name=method,
                x=[f"{o} P={p}" for o, p in groups],
                y=[mine[g].seconds if g in mine else None for g in groups],
                marker_color=_COLORS[n % len(_COLORS)],
            )
        )
    fig.update_layout(
        barmode="group",
        title=f"{model}: predicted time to target (s; missing bar: target never reached)",
        yaxis_title="seconds",
    )
    return fig


def write_study_report(
    out: Path, configs: Sequence[StudyConfig], profiles: Mapping[str, Profile] | None = None
) -> Path:
    """Write ``README.md``, ``curves.html`` and ``risk_fit.json`` under ``out`` from each
    model's ``out/<model>/runs.jsonl``; returns the markdown file. ``profiles[model]`` is the
    hardware the time to target is simulated on (``pipeoptim profile`` of the same model;
    default: this machine, one thread per stage, profiled once into
    ``out/<model>/profile.json`` and reused)."""
    from pipeoptim.viz.report import offline_page

    md = ["# Convergence study: results", ""]
    md += [
        "Produced by `python examples/convergence/run.py` (every stage in one process: the "
        "local transport, bitwise equal to the distributed run). Each evaluation drains the "
        "pipeline, as a checkpoint does, so the first P−1 mini-batches after it run with a "
        "smaller prediction distance.",
        "",
    ]
    html_parts: list[str] = []
    points: list[RiskFitPoint] = []
    closure_all: list[dict[str, Any]] = []
    for config in configs:
        records = load_records(out / config.model / "runs.jsonl")
        if not records:
            md += [f"## {config.model}", "", "no runs recorded", ""]
            continue
        rates = choose_rates(config, records)
        main = {s.key for s in main_specs(config, rates)}
        mine = [r for r in records if r.spec.key in main]
        # runs of an earlier configuration (other steps or rates) stay on file, unused
        used = main | {s.key for s in sweep_specs(config)}
        records = [r for r in records if r.spec.key in used]
        cells = aggregate(mine)
        seconds = sum(r.seconds for r in records)
        md += [f"## {config.model}", ""]
        md.append(
            f"{len(mine)} runs of {_steps_text(config)} mini-batches of {config.batch_size} "
            f"({len(records)} with the sweep, {seconds / 60:.0f} min of training); rates "
            + ", ".join(
                f"{o}: {b:g}" + (f" (higher: {h:g})" if h and config.high_rate else "")
                for o, (b, h) in rates.items()
            )
            + " (best final test metric of gpipe in the sweep "
            + ", ".join(f"{o} {list(config.rates[o])}" for o in config.optimizers)
            + ")."
        )
        md.append("")
        for title, lr_of in rate_sets(config, rates):
            md += [f"### Final, {title}", "", *final_table(config, cells, lr_of), ""]
        closure = closure_rows(mine)
        closure_all += [r for r in closure if r["lr"] == rates[r["optimizer"]][0]]
        table = closure_table(closure, {o: r[0] for o, r in rates.items()})
        if table:
            md += [
                "### Prediction closure (chosen rate, seed 0)",
                "",
                "Share of the stale distance ‖W_forward − W_backward‖ the prediction removed, "
                "1 − median ‖Ŵ − W_backward‖ / ‖W_forward − W_backward‖ over every predicted "
                "forward; s is the prediction distance. Stages without weights are blank.",
                "",
                *table,
                "",
            ]
        target = TARGETS[config.model]
        chosen = (profiles or {}).get(config.model)
        pinned = out / config.model / "profile.json"
        if chosen is not None:
            check_profile(chosen, config.model)
        else:
            # this machine's profile, taken once and kept beside the runs, so redrawing the
            # report gives the same times
            if not pinned.exists():
                machine_profile(config.model, config.batch_size, config.optimizers[0]).save(pinned)
            chosen = Profile.load(pinned)
        times = time_to_target(config, cells, rates, target, chosen)
        hardware = (
            f"Hardware: the profile given ({chosen.device}, batch {chosen.batch_size})."
            if profiles and config.model in profiles
            else f"Hardware: this machine's profile of the model, one thread per stage "
            f"({config.model}/profile.json, batch {chosen.batch_size})."
        )
        md += [
            "### Time to target (chosen rate)",
            "",
            hardware,
            "",
            *time_table(config, times, target),
            "",
        ]
        points += risk_points(config, cells, rates, target, closure)
        html_parts.append(f"<h2>{config.model}</h2>")
        for fig in [*_curves_figures(config, cells, rates), _time_figure(config.model, times)]:
            html_parts.append(fig.to_html(full_html=False, include_plotlyjs=False))
    fit = fit_risk(points)
    md += [
        "## Convergence-risk fit",
        "",
        "Extra samples to the target over gpipe, against the uncorrected distance e "
        "(`pipeoptim.plan.risk`), fitted through the origin per optimizer: extra ≈ κ·e.",
        "",
        "| optimizer | κ | points |",
        "|---|---|---|",
        *[f"| {opt} | {k:.3f} | {n} |" for opt, (k, n) in sorted(fit.items())],
        "",
    ]
    (out / "risk_fit.json").write_text(
        json.dumps(
            {
                "kappa": {o: round(k, 4) for o, (k, _) in sorted(fit.items())},
                "closure_table": {
                    f"{rule}/{opt}": by_s
                    for (rule, opt), by_s in closure_from_rows(closure_all).items()
                },
                "closure": closure_all,
                "points": [p.to_dict() for p in points],
            },
            indent=1,
        )
        + "\n"
    )
    (out / "curves.html").write_text(offline_page("pipeoptim convergence study", html_parts))
    path = out / "README.md"
    path.write_text("\n".join(md) + "\n")
    return path
