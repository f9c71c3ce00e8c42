"""The demo's report: one self-contained HTML page (plotly.js inline, opens offline) and the
JSON of every figure on it, drawn from the steps' stored results and the runs' traces.

The page reads top-down as the answer to "which method should I run, and what will it cost
me?": the recommendation in one sentence with why, the summary of the two real runs, every
method as the simulator predicts it, the measured and simulated timelines on one axis,
memory and the prediction distance s per stage, the loss curves, and how far the
calibrated simulator was from the measurements. Each section has an ``id`` (the tests and
the README's tour refer to them).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from pipeoptim.calibrate import BUBBLE_NOTE_RATIO
from pipeoptim.demo.summary import count, recommendation, summary_headers, summary_rows
from pipeoptim.plan.units import format_bytes, format_distances
from pipeoptim.trace import Trace, TraceEvent
from pipeoptim.viz.overview import (
    curves_figure,
    errors_figure,
    method_colors,
    methods_figure,
    stage_bars_figure,
)
from pipeoptim.viz.report import html_table, offline_page
from pipeoptim.viz.timeline import overlay_figure

__all__ = ["SECTIONS", "build_figures", "render_page"]

SECTIONS = (
    "recommendation",
    "summary",
    "methods",
    "timelines",
    "memory",
    "distance",
    "convergence",
    "calibration",
    "files",
)
"""The report's sections, in page order (each an HTML ``id``)."""

TIMELINE_MINI_BATCHES = 8
"""Mini-batches of each run the timelines draw: enough to see the steady state, few enough
that every action is a readable bar."""

_COMPUTE = ("F", "B", "I", "W", "U")

_EXTRA_STYLE = """<style>
.lead { font-size: 17px; line-height: 1.45; max-width: 1100px; background: #f3f7fb;
  border-left: 4px solid #4C78A8; padding: 10px 14px; }
section { margin-bottom: 28px; } .why { max-width: 1100px; }
</style>"""


def _mib(values: Sequence[float | int | None]) -> list[float | None]:
    return [None if v is None else float(v) / 2**20 for v in values]


def _window(trace: Trace, first: int, count: int) -> Trace:
    """The compute actions of mini-batches ``first .. first + count - 1`` (a micro-batch's
    number is global: mini-batch t holds t*M .. t*M + M-1; an update's is t)."""
    m = max(1, int(trace.meta.get("micro_batches") or 1))

    def mini_batch(e: TraceEvent) -> int:
        return e.mb if e.kind == "U" else e.mb // m

    events = [
        e for e in trace.events if e.kind in _COMPUTE and first <= mini_batch(e) < first + count
    ]
    return Trace(events=events, memory=[], meta=dict(trace.meta))


def _steady_window(trace: Trace) -> tuple[int, int]:
    """(first, count): :data:`TIMELINE_MINI_BATCHES` mini-batches from the middle of the
    run, past the warm-up (first calls, optimizer state) and before the drain."""
    n = max(1, int(trace.meta.get("mini_batches") or 1))
    count = min(n, TIMELINE_MINI_BATCHES)
    return max(0, (n - count) // 2), count


def build_figures(
    results: Mapping[str, Any], measured: Mapping[str, Trace], predicted: Mapping[str, Trace]
) -> dict[str, go.Figure]:
    """Every figure of the report, by the name its JSON file gets."""
    plan = results["plan"]
    rows = plan["methods"]
    colors = method_colors([r["method"] for r in rows])
    trained = [plan["recommended"], plan["rival"]]
    figs: dict[str, go.Figure] = {}
    figs["methods"] = methods_figure(
        [{**r, "weight_copies": max(r["weight_copies"] or [1])} for r in rows], colors
    )
    for m in trained:
        first, count = _steady_window(measured[m])
        figs[f"timeline-{m}"] = overlay_figure(
            _window(measured[m], first, count),
            _window(predicted[m], first, count),
            title=f"{m}: measured (one process per stage) and simulated from its own "
            f"measured costs, mini-batches {first}-{first + count - 1}",
        )
    cal = results["calibrate"]["runs"]
    figs["memory-per-stage"] = stage_bars_figure(
        {
            "predicted (planner's memory model), every method": {
                r["method"]: _mib(r["stage_memory_bytes"]) for r in rows
            },
            "measured peak, the two real runs": {
                f"{m} measured": _mib(cal[m]["measured_stage_memory_bytes"]) for m in trained
            },
        },
        colors,
        title="memory per stage (MiB)",
        patterned=[f"{m} measured" for m in trained],
    )
    figs["distance-per-stage"] = stage_bars_figure(
        {
            "prediction distance s (updates between a forward and its backward)": {
                r["method"]: r["distances"] for r in rows
            },
            "weight staleness of the applied gradients (updates)": {
                r["method"]: r["staleness"] for r in rows
            },
        },
        colors,
        title="s and staleness per stage: staleness 0 with s > 0 is not 'no staleness'",
    )
    conv = results["converge"]
    metric = next((c["metric"] for c in conv.values()), "accuracy")

    def curve(m: str, x_of: Any) -> tuple[list[float], list[float], list[float]]:
        pts = conv[m]["curve"]
        return (
            [x_of(p) for p in pts],
            [p["train_loss"] for p in pts],
            [p["test_metric"] for p in pts],
        )

    figs["loss-vs-samples"] = curves_figure(
        {m: curve(m, lambda p: p["samples"]) for m in trained if m in conv},
        colors,
        title=f"convergence on one device ({results['options']['stages']} stages emulated): "
        f"against samples seen",
        x_title="samples seen",
        metric=metric,
    )
    rate = {r["method"]: float(r["samples_per_s"]) for r in rows}
    figs["loss-vs-time"] = curves_figure(
        {
            m: curve(m, lambda p, m=m: p["samples"] / rate[m])
            for m in trained
            if m in conv and rate.get(m, 0.0) > 0
        },
        colors,
        title="the same curves against predicted time: samples / the simulator's samples/s "
        "on the profile, one device per stage",
        x_title="predicted training time (s)",
        metric=metric,
    )
    errors: dict[str, dict[str, float]] = {}
    for m in trained:
        errors[f"{m}, from its own run"] = {
            r["quantity"]: r["relative_error"]
            for r in cal[m]["rows"]
            if r["relative_error"] is not None and math.isfinite(r["relative_error"])
        }
    for c in results["calibrate"]["cross"]:
        errors[f"{c['method']}, from {c['from']}'s run"] = {
            r["quantity"]: r["relative_error"] for r in c["rows"]
        }
    figs["calibration-errors"] = errors_figure(errors)
    return figs


def _methods_table(plan: Mapping[str, Any]) -> str:
    head = [
        "method",
        "M",
        "samples/s",
        "effective/s",
        "bubble",
        "peak memory",
        "weight copies",
        "s per stage",
        "staleness",
        "conv. risk",
    ]
    body = [
        [
            r["method"] + (" (recommended)" if r["method"] == plan["recommended"] else ""),
            r["micro_batches"],
            f"{r['samples_per_s']:,.0f}",
            f"{r['effective_samples_per_s']:,.0f}",
            f"{r['bubble_ratio']:.3f}",
            format_bytes(int(r["peak_memory_bytes"])),
            format_distances(r["weight_copies"]) if r["weight_copies"] else "1",
            format_distances(r["distances"]),
            format_distances(r["staleness"]),
            f"+{100 * r['risk']:.0f}%",
        ]
        for r in plan["methods"]
    ]
    return html_table(head, body)


def _calibration_tables(results: Mapping[str, Any]) -> list[str]:
    parts = []
    head = ["quantity", "measured", "predicted", "error"]
    for m, run in results["calibrate"]["runs"].items():
        parts.append(f"<h3>{html.escape(m)}: its own measured costs, simulated</h3>")
        parts.append(html_table(head, [_row(r) for r in run["rows"]]))
    for c in results["calibrate"]["cross"]:
        parts.append(
            f"<h3>{html.escape(c['method'])} predicted from {html.escape(c['from'])}'s "
            f"measured costs</h3>"
        )
        parts.append(html_table(head, [_row(r) for r in c["rows"]]))
    return parts


def _row(r: Mapping[str, Any]) -> list[str]:
    def show(v: float) -> str:
        if r["unit"] == "B":
            return format_bytes(int(v))
        return f"{v:.4g}" + (f" {r['unit']}" if r["unit"] else "")

    err = r["relative_error"]
    ok = err is not None and math.isfinite(err)
    return [
        r["quantity"],
        show(r["measured"]),
        show(r["predicted"]),
        f"{100 * err:+.1f}%" if ok else "n/a",
    ]


def _calibration_notes(results: Mapping[str, Any]) -> list[str]:
    """How the calibration modelled the runs: what it fitted from each (shared cores, the
    fixed cost of a message, the ranks' clocks), and where calibration charged the actions
    with time the runs counted as idle."""
    cpus, stages = results["profile"]["cpus"], results["options"]["stages"]
    notes = []
    if cpus < stages:
        notes.append(
            f"This machine has fewer cores ({cpus}) than the real runs have processes "
            f"({stages}): the ranks take turns on the cores. The calibrated simulator models "
            f"it: the busy ranks share the cores (processor sharing), and every message "
            f"costs its sender and its receiver a fixed time, both fitted from the run."
        )
    runs = results["calibrate"]["runs"]
    for method, run in runs.items():
        fitted = run.get("fitted")
        if fitted:
            notes.append(f"Fitted from the {method} run: " + "; ".join(fitted) + ".")
    charged = {
        method: float(run["compute_ratio"])
        for method, run in runs.items()
        if run.get("compute_ratio") is not None and run["compute_ratio"] > BUBBLE_NOTE_RATIO
    }
    if charged:
        held = ", ".join(f"{ratio:.1f}x for {method}" for method, ratio in charged.items())
        notes.append(
            f"The calibrated actions hold more time than the real runs' compute events "
            f"({held}): calibration charges each message's fixed cost and the executor's "
            f"time between actions to the actions, so the time per mini-batch comes out "
            f"right, while the real run's trace counts that time as idle. The bubble ratios "
            f"compare unlike things there; compare the time per mini-batch and the "
            f"throughput (calibrate.bubble_note)."
        )
    return notes


def _notes(results: Mapping[str, Any]) -> list[str]:
    """What a careful reader should know about how the numbers were made."""
    options, profile = results["options"], results["profile"]
    notes = [
        f"Machine: {profile['cpus']} CPU core(s); profiled on {profile['device']} with "
        f"{profile['threads']} thread(s) per rank, as each of the {options['stages']} ranks "
        f"of the real runs gets; torch {profile['torch']}.",
    ]
    host = results["plan"].get("host")
    if host:
        notes.append(
            "The offline prediction (simulated/s) ran on the host the profile measured: "
            + "; ".join(host)
            + "."
        )
    notes += _calibration_notes(results)
    for m in (results["plan"]["recommended"], results["plan"]["rival"]):
        planned = results["plan"]["plans"][m]["micro_batches"]
        emulated = results["converge"].get(m, {}).get("micro_batches", planned)
        if planned != emulated:
            notes.append(
                f"The convergence run of {m} uses the study's {emulated} micro-batches (the "
                f"real run {planned})."
            )
    notes.append(
        "The convergence runs use the convergence study's even split of the layers; the real "
        "runs use the planner's partition of each method."
    )
    return notes


def render_page(
    results: Mapping[str, Any], figures: Mapping[str, go.Figure], files: Sequence[str]
) -> str:
    """The report as one HTML string."""
    options, plan = results["options"], results["plan"]
    config = {"displaylogo": False, "responsive": True}

    def fig(name: str) -> str:
        return str(figures[name].to_html(full_html=False, include_plotlyjs=False, config=config))

    def section(sid: str, title: str, *parts: str) -> str:
        head = f"<h2>{html.escape(title)}</h2>" if title else ""
        return f"<section id='{sid}'>{head}{''.join(parts)}</section>"

    trained = [plan["recommended"], plan["rival"]]
    title = f"pipeoptim demo: {options['model']} on {count(options['stages'], 'stage')}"
    page = [
        _EXTRA_STYLE,
        f"<h1>{html.escape(title)}</h1>",
        section(
            "recommendation",
            "",
            f"<p class='lead'><b>{html.escape(recommendation(results))}</b></p>",
            f"<p class='note why'>The planner's reasoning: {html.escape(plan['why'])}</p>",
        ),
        section(
            "summary",
            "The two real runs",
            html_table(summary_headers(results), summary_rows(results)),
            "<p class='note'>simulated/s: the planner's prediction from the profile alone, "
            "before any run, on the host the profile measured (its cores shared by the ranks, "
            "the measured cost of each message and of each action beyond its layers: see the "
            "notes); measured/s: the steady state of the real run; calibrated/s: the "
            "simulator on the run's own measured costs, and time error its error on the "
            "time per mini-batch.</p>",
        ),
        section(
            "methods",
            "Every method, simulated on the profile",
            _methods_table(plan),
            fig("methods"),
        ),
        section(
            "timelines",
            "Measured and simulated, one time axis",
            *(fig(f"timeline-{m}") for m in trained),
        ),
        section("memory", "Memory per stage", fig("memory-per-stage")),
        section("distance", "Prediction distance s per stage", fig("distance-per-stage")),
        section(
            "convergence",
            "Convergence, emulated on one device",
            fig("loss-vs-samples"),
            fig("loss-vs-time"),
        ),
        section(
            "calibration",
            "Calibration: the simulator against the measurements",
            *(f"<p class='note'>{html.escape(n)}</p>" for n in _calibration_notes(results)),
            fig("calibration-errors"),
            *_calibration_tables(results),
        ),
        section(
            "files",
            "How this was made",
            *(f"<p class='note'>{html.escape(n)}</p>" for n in _notes(results)),
            "<p class='note'>Files in this folder: "
            + ", ".join(f"<code>{html.escape(f)}</code>" for f in files)
            + ".</p>",
        ),
    ]
    return offline_page(title, page)


def write_figures(figures: Mapping[str, go.Figure], folder: Path) -> list[Path]:
    """Each figure's plotly JSON as ``folder/NAME.json``."""
    from pipeoptim.demo.resume import write_atomic

    out = []
    for name, figure in figures.items():
        text: str = figure.to_json()

        def write(path: Path, text: str = text) -> None:
            path.write_text(text, encoding="utf-8")

        out.append(write_atomic(folder / f"{name}.json", write))
    return out
