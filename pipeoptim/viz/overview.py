"""Figures that compare methods at a glance, drawn from plain numbers: the planner's
predictions side by side, a quantity per stage, training curves, and relative errors.

The demo's report (:mod:`pipeoptim.demo.report`) is drawn from the JSON its steps stored, not
from live library objects, so these take lists and dicts; each method keeps one colour in
every figure (:func:`method_colors`), so a reader follows it from the table to the curves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pipeoptim.viz.report import PALETTE

__all__ = [
    "curves_figure",
    "errors_figure",
    "method_colors",
    "methods_figure",
    "stage_bars_figure",
]


def method_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per name, in order (the palette repeats past ten)."""
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(dict.fromkeys(names))}


def methods_figure(
    rows: Sequence[Mapping[str, float | int | str]],
    colors: Mapping[str, str],
    *,
    title: str = "every method, simulated on the profile",
) -> go.Figure:
    """Per method (``rows``: method, samples_per_s, effective_samples_per_s, bubble_ratio,
    peak_memory_bytes, weight_copies): throughput raw and after the convergence risk,
    bubble ratio, peak stage memory and most weight copies on a stage."""
    names = [str(r["method"]) for r in rows]
    palette = [colors.get(n, "#888") for n in names]
    panels = [
        "samples/s (light: after convergence risk)",
        "bubble ratio",
        "peak stage memory (MiB)",
        "weight copies (most on a stage)",
    ]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=panels)
    values = [
        [float(r["samples_per_s"]) for r in rows],
        [float(r["bubble_ratio"]) for r in rows],
        [float(r["peak_memory_bytes"]) / 2**20 for r in rows],
        [float(r["weight_copies"]) for r in rows],
    ]
    for col, ys in enumerate(values, start=1):
        fig.add_trace(
            go.Bar(x=names, y=ys, marker_color=palette, showlegend=False, name=panels[col - 1]),
            row=1,
            col=col,
        )
    fig.add_trace(
        go.Bar(
            x=names,
            y=[float(r["effective_samples_per_s"]) for r in rows],
            marker={"color": "rgba(255,255,255,0.55)", "line": {"width": 0}},
            width=0.5,
            showlegend=False,
            name="effective samples/s",
        ),
        row=1,
        col=1,
    )
    fig.update_layout(
        title=title, barmode="overlay", height=380, margin={"l": 50, "r": 20, "t": 80, "b": 90}
    )
    fig.update_annotations(font_size=11)
    return fig


def stage_bars_figure(
    panels: Mapping[str, Mapping[str, Sequence[float | None]]],
    colors: Mapping[str, str],
    *,
    title: str,
    patterned: Sequence[str] = (),
) -> go.Figure:
    """Grouped bars per stage, one panel per key of ``panels`` (panel title -> series name
    -> value per stage); series named in ``patterned`` are hatched (e.g. measured beside
    predicted). A series' colour is that of the first word of its name."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=list(panels))
    shown: set[str] = set()
    for col, series in enumerate(panels.values(), start=1):
        for name, values in series.items():
            color = colors.get(name.split(" ")[0], "#888")
            marker: dict[str, object] = {"color": color}
            if name in patterned:
                marker["pattern"] = {"shape": "/", "fgcolor": "white"}
            fig.add_trace(
                go.Bar(
                    x=[f"stage {k}" for k in range(len(values))],
                    y=list(values),
                    name=name,
                    legendgroup=name,
                    showlegend=name not in shown,
                    marker=marker,
                ),
                row=1,
                col=col,
            )
            shown.add(name)
    fig.update_layout(
        title=title,
        barmode="group",
        height=380,
        margin={"l": 50, "r": 20, "t": 80, "b": 50},
        legend={"font": {"size": 11}},
    )
    fig.update_annotations(font_size=12)
    return fig


def curves_figure(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
    colors: Mapping[str, str],
    *,
    title: str,
    x_title: str,
    metric: str,
) -> go.Figure:
    """Two panels over ``x``: training loss (log scale) and the test ``metric``, one line
    per run (``curves``: name -> (x, training loss, test metric))."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["training loss", f"test {metric}"])
    for name, (xs, losses, metrics) in curves.items():
        color = colors.get(name, "#888")
        for col, ys in ((1, losses), (2, metrics)):
            fig.add_trace(
                go.Scatter(
                    x=list(xs),
                    y=list(ys),
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    mode="lines+markers",
                    line={"color": color},
                ),
                row=1,
                col=col,
            )
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text=x_title, rangemode="tozero")
    fig.update_layout(title=title, height=380, margin={"l": 60, "r": 20, "t": 80, "b": 60})
    return fig


def errors_figure(
    errors: Mapping[str, Mapping[str, float]],
    *,
    title: str = "simulator against measurement: relative error",
) -> go.Figure:
    """Grouped bars of relative errors in percent (``errors``: run -> quantity -> error as
    a fraction); 0 is a perfect prediction, above 0 the simulator predicted too much."""
    fig = go.Figure()
    for i, (run, by_quantity) in enumerate(errors.items()):
        fig.add_trace(
            go.Bar(
                x=list(by_quantity),
                y=[100 * v for v in by_quantity.values()],
                name=run,
                marker_color=PALETTE[i % len(PALETTE)],
                hovertemplate="%{x}: %{y:+.1f}%<extra>" + run + "</extra>",
            )
        )
    fig.update_layout(
        title=title,
        barmode="group",
        yaxis={"title": "(predicted - measured) / measured, %", "zeroline": True},
        height=380,
        margin={"l": 60, "r": 20, "t": 60, "b": 90},
    )
    return fig
