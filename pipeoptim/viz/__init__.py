"""Plotly figures and the self-contained HTML report, drawn from any Trace.

Simulated and measured runs share the :class:`~pipeoptim.trace.Trace` schema, so one set of
figures shows both: the action timeline, memory over time, staleness per stage and a
side-by-side comparison of methods, gathered in one HTML file that opens with no network.
"""

from pipeoptim.viz.report import comparison_figure, render_report, staleness_figure, write_report
from pipeoptim.viz.timeline import KIND_COLORS, memory_figure, memory_series, timeline_figure

__all__ = [
    "KIND_COLORS",
    "comparison_figure",
    "memory_figure",
    "memory_series",
    "render_report",
    "staleness_figure",
    "timeline_figure",
    "write_report",
]
