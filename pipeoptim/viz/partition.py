"""The partition drawn: per-stage time (compute and communication) and memory against the cap."""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pipeoptim.plan.partition_cost import Partition
from pipeoptim.plan.profile import Profile
from pipeoptim.viz.report import offline_page


def partition_figure(
    partition: Partition, profile: Profile, *, memory_cap_bytes: int | None = None
) -> go.Figure:
    """Two bar charts side by side, one bar per stage; hover names the stage's layers."""
    labels = [f"stage {k}" for k in range(partition.num_stages)]
    layers = [
        f"layers {a}..{b - 1}: "
        + ", ".join(layer.name for layer in profile.layers[a:b][:6])
        + (" ..." if b - a > 6 else "")
        for a, b in partition.boundaries
    ]
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("time per pipeline unit (ms)", "memory (MiB)")
    )
    compute = partition.stage_compute_s or partition.stage_times
    comm = partition.stage_comm_s or tuple(0.0 for _ in compute)
    fig.add_bar(
        x=labels,
        y=[c * 1e3 for c in compute],
        name="compute",
        hovertext=layers,
        marker_color="#4c78a8",
        row=1,
        col=1,
    )
    fig.add_bar(
        x=labels,
        y=[c * 1e3 for c in comm],
        name="communication",
        hovertext=layers,
        marker_color="#f58518",
        row=1,
        col=1,
    )
    fig.add_bar(
        x=labels,
        y=[m / 2**20 for m in partition.stage_memory],
        name="memory",
        hovertext=layers,
        marker_color="#54a24b",
        row=1,
        col=2,
    )
    if memory_cap_bytes:
        fig.add_hline(
            y=memory_cap_bytes / 2**20,
            line_dash="dash",
            line_color="#e45756",
            annotation_text="cap",
            row=1,
            col=2,
        )
    fig.update_layout(
        barmode="stack",
        height=420,
        title="partition: slowest stage "
        f"{partition.bottleneck_s * 1e3:.3g} ms (stage {partition.bottleneck_stage})",
    )
    return fig


def write_partition_html(
    path: str | Path,
    partition: Partition,
    profile: Profile,
    *,
    memory_cap_bytes: int | None = None,
    summary: str = "",
) -> Path:
    """A self-contained page (plotly.js inline, opens offline)."""
    fig = partition_figure(partition, profile, memory_cap_bytes=memory_cap_bytes)
    body = fig.to_html(full_html=False, include_plotlyjs=False)
    out = Path(path)
    out.write_text(
        offline_page("pipeoptim plan", [f"<p>{html.escape(summary)}</p>", body]),
        encoding="utf-8",
    )
    return out
