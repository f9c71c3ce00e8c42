"""Plotly figures of one run over time: the action timeline and memory per stage.

Both read only a :class:`~pipeoptim.trace.Trace`, so a simulated and a measured run draw
alike. The timeline has one row per rank (compute: F, B, U) and one row per link direction
for transfers (``SEND_F``/``SEND_B``, named after the stages they join); receive events of a
measured run get a row per rank. Hovering a bar shows stage, micro-batch, weight version,
prediction distance, duration and bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import plotly.graph_objects as go

from pipeoptim.trace import Trace, TraceEvent

__all__ = ["KIND_COLORS", "memory_figure", "memory_series", "overlay_figure", "timeline_figure"]

KIND_COLORS: dict[str, str] = {
    "F": "#4C78A8",
    "B": "#F58518",
    "I": "#E45756",
    "W": "#FFBF79",
    "U": "#54A24B",
    "SEND_F": "#B279A2",
    "SEND_B": "#9D755D",
    "RECV_F": "#BAB0AC",
    "RECV_B": "#79706E",
}
"""Bar colour per action kind (I and W: the halves of a split backward)."""

_COMPUTE = ("F", "B", "I", "W", "U")

_KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "input gradient",
    "W": "weight gradient",
    "U": "update",
    "SEND_F": "send activation",
    "SEND_B": "send gradient",
    "RECV_F": "receive activation",
    "RECV_B": "receive gradient",
}


def _row(e: TraceEvent) -> tuple[tuple[int, int, int], str]:
    """Sort key and label of the row an event is drawn on."""
    if e.kind == "SEND_F":
        return (e.stage, 1, 0), f"link {e.stage}→{e.stage + 1}"
    if e.kind == "SEND_B":
        return (e.stage - 1, 1, 1), f"link {e.stage}→{e.stage - 1}"
    if e.kind.startswith("RECV"):
        return (e.rank, 2, 0), f"rank {e.rank} recv"
    return (e.rank, 0, 0), f"rank {e.rank}"


def timeline_figure(
    trace: Trace,
    *,
    title: str | None = None,
    max_events: int = 20_000,
    labels: bool | None = None,
) -> go.Figure:
    """One horizontal bar per action, one row per rank and per link, coloured by kind.

    Only the first ``max_events`` events (by start time) are drawn, so huge runs stay
    viewable; the title says when events were left out. ``labels`` writes the action
    (e.g. ``F12``) into each bar (default: when at most 400 events are drawn).
    """
    by_time = attrgetter("start", "rank")
    total = len(trace.events)
    if total > max_events:
        shown = heapq.nsmallest(max_events, trace.events, key=by_time)
    else:
        shown = sorted(trace.events, key=by_time)
    rows: dict[str, tuple[int, int, int]] = {}
    for e in shown:
        key, label = _row(e)
        rows[label] = key
    order = sorted(rows, key=lambda label: rows[label])
    with_labels = len(shown) <= 400 if labels is None else labels
    fig = go.Figure()
    kinds = sorted(
        {e.kind for e in shown},
        key=lambda k: list(KIND_COLORS).index(k) if k in KIND_COLORS else len(KIND_COLORS),
    )
    for kind in kinds:
        evs = [e for e in shown if e.kind == kind]
        fig.add_trace(
            go.Bar(
                name=_KIND_NAMES.get(kind, kind),
                orientation="h",
                y=np.array([_row(e)[1] for e in evs], dtype=object),
                x=np.array([e.duration for e in evs], dtype=float),
                base=np.array([e.start for e in evs], dtype=float),
                marker={
                    "color": KIND_COLORS.get(kind, "#888888"),
                    "line": {"width": 0.5, "color": "white"},
                },
                text=[f"{e.kind}{e.mb}" if e.kind in _COMPUTE else str(e.mb) for e in evs]
                if with_labels
                else None,
                textposition="inside" if with_labels else None,
                insidetextanchor="middle",
                customdata=np.array(
                    [
                        [
                            e.stage,
                            e.mb,
                            e.weight_version,
                            e.distance,
                            e.duration,
                            e.rank,
                            e.bytes / 2**20,
                        ]
                        for e in evs
                    ],
                    dtype=float,
                ),
                hovertemplate=(
                    f"<b>{_KIND_NAMES.get(kind, kind)}</b><br>stage %{{customdata[0]}}, "
                    "micro-batch %{customdata[1]}<br>rank %{customdata[5]}<br>"
                    "weight version %{customdata[2]} (distance %{customdata[3]})<br>"
                    "start %{base:.4g} s, duration %{customdata[4]:.4g} s<br>"
                    "%{customdata[6]:.4g} MiB<extra></extra>"
                ),
            )
        )
    left = total - len(shown)
    name = title or _default_title(trace)
    if left:
        name += f" (first {len(shown):,} of {total:,} events shown)"
    fig.update_layout(
        title=name,
        barmode="overlay",
        bargap=0.15,
        xaxis={"title": "time (s)", "rangemode": "tozero"},
        yaxis={"categoryorder": "array", "categoryarray": order, "autorange": "reversed"},
        legend={"orientation": "h", "y": -0.15},
        height=max(260, 60 + 34 * len(order)),
        margin={"l": 90, "r": 20, "t": 50, "b": 60},
        uniformtext={"minsize": 8, "mode": "hide"},
    )
    return fig


def _default_title(trace: Trace) -> str:
    meta = trace.meta
    parts = [str(meta.get("method") or "run")]
    if meta.get("num_ranks") is not None:
        parts.append(f"P={meta['num_ranks']}")
    if meta.get("micro_batches") is not None:
        parts.append(f"M={meta['micro_batches']}")
    if meta.get("mini_batches") is not None:
        parts.append(f"N={meta['mini_batches']}")
    return "timeline: " + " ".join(parts)


def memory_series(trace: Trace) -> dict[str, tuple[list[float], list[int]]]:
    """Memory over time per stage (``"stage:<k>"`` detail) or, without it, per rank."""
    series: dict[str, tuple[list[float], list[int]]] = {}
    for s in sorted(trace.memory, key=lambda m: (m.time, m.rank)):
        stages = [(k, v) for k, v in s.detail.items() if k.startswith("stage:")]
        items = [(f"stage {k[6:]}", v) for k, v in stages] or [(f"rank {s.rank}", s.bytes)]
        for label, value in items:
            xs, ys = series.setdefault(label, ([], []))
            xs.append(s.time)
            ys.append(int(value))
    return dict(sorted(series.items(), key=lambda kv: int(kv[0].split()[1])))


def _bucket_max(xs: list[float], ys: list[int], limit: int) -> tuple[list[float], list[int]]:
    """At most ``limit`` points: each bucket of consecutive samples keeps its first time and
    its largest value, so peaks survive."""
    if len(xs) <= limit:
        return xs, ys
    size = -(-len(xs) // limit)
    return xs[::size], [max(ys[i : i + size]) for i in range(0, len(ys), size)]


def memory_figure(trace: Trace, *, title: str | None = None, max_points: int = 2_000) -> go.Figure:
    """Memory per stage over time (step lines), in MiB; at most ``max_points`` per stage
    (bucketed by maximum, so peaks stay visible)."""
    fig = go.Figure()
    end = max((e.end for e in trace.events), default=0.0)
    for label, series in memory_series(trace).items():
        xs, ys = _bucket_max(*series, max_points)
        xs2: Sequence[float] = [*xs, max(end, xs[-1])]
        ys2: Sequence[int] = [*ys, ys[-1]]
        fig.add_trace(
            go.Scatter(
                x=np.array(xs2, dtype=float),
                y=np.array(ys2, dtype=float) / 2**20,
                name=label,
                mode="lines",
                line={"shape": "hv"},
                hovertemplate=f"{label}<br>t=%{{x:.4g}} s<br>%{{y:.4g}} MiB<extra></extra>",
            )
        )
    layout: dict[str, Any] = {
        "title": title or "memory per stage",
        "xaxis": {"title": "time (s)", "rangemode": "tozero"},
        "yaxis": {"title": "MiB", "rangemode": "tozero"},
        "height": 320,
        "margin": {"l": 60, "r": 20, "t": 50, "b": 50},
    }
    if not trace.memory:
        layout["annotations"] = [
            {
                "text": "no memory samples in this trace",
                "showarrow": False,
                "x": 0.5,
                "y": 0.5,
                "xref": "paper",
                "yref": "paper",
            }
        ]
    fig.update_layout(**layout)
    return fig


def overlay_figure(
    measured: Trace, predicted: Trace, *, title: str | None = None, max_events: int = 20_000
) -> go.Figure:
    """Measured and simulated compute actions of one run on one time axis, per rank.

    Each rank gets two rows, ``rank r measured`` above ``rank r simulated``; both runs
    start at 0 (their first compute action), so a drift between them shows where the
    prediction loses time. Only the first ``max_events`` compute events of each run by
    start time are drawn.
    """
    fig = go.Figure()
    order: list[str] = []
    shown_kinds: set[str] = set()
    for label, trace, opacity in (("measured", measured, 1.0), ("simulated", predicted, 0.6)):
        compute = [e for e in trace.events if e.kind in _COMPUTE]
        events = heapq.nsmallest(max_events, compute, key=attrgetter("start", "rank"))
        origin = min((e.start for e in events), default=0.0)
        for kind in _COMPUTE:
            evs = [e for e in events if e.kind == kind]
            if not evs:
                continue
            fig.add_trace(
                go.Bar(
                    name=_KIND_NAMES[kind],
                    legendgroup=kind,
                    showlegend=kind not in shown_kinds,
                    orientation="h",
                    y=np.array([f"rank {e.rank} {label}" for e in evs], dtype=object),
                    x=np.array([e.duration for e in evs], dtype=float),
                    base=np.array([e.start - origin for e in evs], dtype=float),
                    opacity=opacity,
                    marker={"color": KIND_COLORS[kind], "line": {"width": 0.5, "color": "white"}},
                    customdata=np.array([[e.stage, e.mb, e.duration] for e in evs], dtype=float),
                    hovertemplate=(
                        f"<b>{label} {_KIND_NAMES[kind]}</b><br>stage %{{customdata[0]}}, "
                        "micro-batch %{customdata[1]}<br>start %{base:.4g} s, "
                        "duration %{customdata[2]:.4g} s<extra></extra>"
                    ),
                )
            )
            shown_kinds.add(kind)
        order += [f"rank {r} {label}" for r in sorted({e.rank for e in events})]
    rows = sorted(order, key=lambda row: (int(row.split()[1]), row.endswith("simulated")))
    fig.update_layout(
        title=title or "measured and simulated, one time axis",
        barmode="overlay",
        bargap=0.15,
        xaxis={"title": "time since the first action (s)", "rangemode": "tozero"},
        yaxis={"categoryorder": "array", "categoryarray": rows, "autorange": "reversed"},
        legend={"orientation": "h", "y": -0.15},
        height=max(260, 60 + 34 * len(rows)),
        margin={"l": 140, "r": 20, "t": 50, "b": 60},
    )
    return fig
