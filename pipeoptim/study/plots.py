"""The study's plotly figures: mean curves per (optimizer, lr, depth) and the predicted time
to target per method.

Plotly is imported inside the functions, so reading records and writing the tables never
loads it; :func:`pipeoptim.study.report.write_study_report` embeds the figures in
``curves.html``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from pipeoptim.study.cells import Cell, higher_is_better, method_labels, rate_sets
from pipeoptim.study.grid import StudyConfig
from pipeoptim.study.targets import TimeToTarget

__all__ = ["curves_figures", "time_figure"]


def curves_figures(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
) -> list[Any]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figs = []
    metric = "test accuracy" if higher_is_better(config.model) else "test perplexity"
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
                    for n, method in enumerate(method_labels(config)):
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


def time_figure(model: str, rows: Sequence[TimeToTarget]) -> Any:
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
