"""Per-stage and per-method charts, and the self-contained HTML report.

The report embeds plotly.js inline (no ``<script src="http...">``), so it opens from a file
with no network: on an air-gapped cluster, in a CI artifact, in an e-mail. It holds a summary
table, a side-by-side comparison of the runs (throughput, bubble ratio, peak memory,
staleness, weight copies) and, per run, the timeline, memory over time and staleness per
stage.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from pipeoptim.metrics import RunMetrics, compute_metrics
from pipeoptim.plan.units import format_bytes
from pipeoptim.trace import Trace
from pipeoptim.viz.timeline import memory_figure, overlay_figure, timeline_figure

PALETTE = (
    "#4C78A8",
    "#F58518",
    "#54A24B",
    "#E45756",
    "#72B7B2",
    "#EECA3B",
    "#B279A2",
    "#FF9DA6",
    "#9D755D",
    "#BAB0AC",
)
"""One colour per method, in the registry's order, shared by every figure that compares methods."""

__all__ = [
    "PALETTE",
    "comparison_figure",
    "html_table",
    "render_calibration",
    "render_report",
    "staleness_figure",
    "write_report",
]


def staleness_figure(metrics: RunMetrics, *, title: str | None = None) -> go.Figure:
    """Per stage: max and mean staleness, max F/B inconsistency, max prediction distance."""
    stages = sorted(metrics.stages)
    labels = [f"stage {k}" for k in stages]
    series = [
        ("max staleness", [metrics.stages[k].max_staleness for k in stages], "#E45756"),
        ("mean staleness", [metrics.stages[k].mean_staleness for k in stages], "#FF9DA6"),
        ("max F/B inconsistency", [metrics.stages[k].max_inconsistency for k in stages], "#72B7B2"),
        ("max prediction distance", [metrics.stages[k].max_distance for k in stages], "#EECA3B"),
    ]
    fig = go.Figure()
    for name, values, color in series:
        fig.add_trace(go.Bar(name=name, x=labels, y=values, marker_color=color))
    fig.update_layout(
        title=title or "weight versions per stage (in updates)",
        barmode="group",
        yaxis={"title": "updates", "rangemode": "tozero", "dtick": 1},
        height=320,
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
    )
    return fig


def comparison_figure(runs: Mapping[str, RunMetrics], *, title: str | None = None) -> go.Figure:
    """Methods side by side: steady throughput, bubble ratio, peak memory, staleness, copies."""
    names = list(runs)
    panels = [
        ("steady throughput (samples/s)", [runs[n].steady_throughput for n in names]),
        ("bubble ratio", [runs[n].bubble_ratio for n in names]),
        (
            "peak memory, fullest stage (MiB)",
            [(runs[n].peak_memory_bytes or 0) / 2**20 for n in names],
        ),
        ("max staleness (updates)", [runs[n].max_staleness for n in names]),
        ("max weight copies", [runs[n].max_weight_copies or 0 for n in names]),
    ]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[0] for p in panels])
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(names))]
    for col, (label, values) in enumerate(panels, start=1):
        fig.add_trace(
            go.Bar(
                x=names,
                y=values,
                marker_color=colors,
                name=label,
                showlegend=False,
                hovertemplate="%{x}: %{y:.4g}<extra>" + label + "</extra>",
            ),
            row=1,
            col=col,
        )
    fig.update_layout(
        title=title or "methods compared",
        height=360,
        margin={"l": 40, "r": 20, "t": 80, "b": 80},
    )
    fig.update_annotations(font_size=11)
    return fig


def _summary_table(runs: Mapping[str, RunMetrics], traces: Mapping[str, Trace]) -> str:
    head = [
        "run",
        "P",
        "M",
        "N",
        "makespan (s)",
        "throughput (samples/s)",
        "steady (samples/s)",
        "bubble",
        "peak memory",
        "max staleness",
        "weight copies",
    ]
    rows = []
    for name, m in runs.items():
        meta = traces[name].meta
        peak = "-" if not m.peak_memory_bytes else format_bytes(m.peak_memory_bytes)
        rows.append(
            [
                name,
                meta.get("num_ranks", m.num_ranks),
                meta.get("micro_batches", "-"),
                meta.get("mini_batches", "-"),
                f"{m.span_s:.4g}",
                f"{m.throughput:.4g}",
                f"{m.steady_throughput:.4g}",
                f"{m.bubble_ratio:.3f}",
                peak,
                m.max_staleness,
                "-" if m.max_weight_copies is None else m.max_weight_copies,
            ]
        )
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body { font-family: system-ui, -apple-system, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
.note { color: #555; font-size: 13px; }
"""


def render_report(
    traces: Mapping[str, Trace],
    *,
    title: str = "pipeoptim simulation report",
    metrics: Mapping[str, RunMetrics] | None = None,
    notes: Sequence[str] = (),
    max_events: int = 20_000,
) -> str:
    """The report as one HTML string (plotly.js inline)."""
    runs = {name: (metrics or {}).get(name) or compute_metrics(t) for name, t in traces.items()}
    config = {"displaylogo": False, "responsive": True}

    def fig_html(fig: go.Figure) -> str:
        return str(fig.to_html(full_html=False, include_plotlyjs=False, config=config))

    parts = [f"<h1>{html.escape(title)}</h1>"]
    parts += [f"<p class='note'>{html.escape(n)}</p>" for n in notes]
    parts.append(_summary_table(runs, traces))
    if runs:
        parts.append(fig_html(comparison_figure(runs)))
    for name, trace in traces.items():
        parts.append(f"<h2>{html.escape(name)}</h2>")
        parts.append(fig_html(timeline_figure(trace, max_events=max_events)))
        parts.append(fig_html(memory_figure(trace)))
        parts.append(fig_html(staleness_figure(runs[name])))
    return offline_page(title, parts)


def offline_page(title: str, parts: Sequence[str]) -> str:
    """A whole HTML page with plotly.js inline, so it opens with no network."""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head>"
        f"<body>{''.join(parts)}</body></html>\n"
    )


def write_report(
    path: str | Path,
    traces: Mapping[str, Trace],
    *,
    title: str = "pipeoptim simulation report",
    metrics: Mapping[str, RunMetrics] | None = None,
    notes: Sequence[str] = (),
    max_events: int = 20_000,
) -> Path:
    """Write the self-contained HTML report of ``traces`` (name -> trace) to ``path``."""
    out = Path(path)
    out.write_text(
        render_report(traces, title=title, metrics=metrics, notes=notes, max_events=max_events),
        encoding="utf-8",
    )
    return out


def html_table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain HTML table (cells escaped)."""
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def render_calibration(
    measured: Trace,
    predicted: Trace,
    errors: Sequence[Sequence[object]],
    what_if: Sequence[Sequence[object]] = (),
    *,
    title: str = "pipeoptim calibration: measured run against the simulator",
    notes: Sequence[str] = (),
    max_events: int = 20_000,
) -> str:
    """One page: the error table (quantity, measured, predicted, error), the what-if
    predictions (method, P, M, time per mini-batch, samples/s, bubble, peak memory, against
    the measured run), both timelines overlaid per rank, and memory over time of both."""
    config = {"displaylogo": False, "responsive": True}

    def fig_html(fig: go.Figure) -> str:
        return str(fig.to_html(full_html=False, include_plotlyjs=False, config=config))

    parts = [f"<h1>{html.escape(title)}</h1>"]
    parts += [f"<p class='note'>{html.escape(n)}</p>" for n in notes]
    parts.append("<h2>measured against predicted</h2>")
    parts.append(html_table(["quantity", "measured", "predicted", "error"], errors))
    if what_if:
        parts.append("<h2>what if: other methods and shapes from the measured costs</h2>")
        head = ["method", "P", "M", "time per mini-batch", "samples/s", "bubble", "peak memory"]
        parts.append(html_table([*head, "vs measured run"], what_if))
    parts.append("<h2>timelines</h2>")
    parts.append(fig_html(overlay_figure(measured, predicted, max_events=max_events)))
    parts.append(fig_html(memory_figure(measured, title="memory, measured")))
    parts.append(fig_html(memory_figure(predicted, title="memory, simulated")))
    return offline_page(title, parts)
