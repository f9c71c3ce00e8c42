"""Figures and the self-contained HTML report, including a headless-browser screenshot."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

from support.headless_chromium import Chromium, png_chunks

from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.sim import CostModel, simulate
from pipeoptim.viz import (
    comparison_figure,
    memory_figure,
    render_report,
    staleness_figure,
    timeline_figure,
    write_report,
)


def _trace(name: str = "pipeoptim", p: int = 3, n: int = 4, **links: float):
    method = get_method(name)
    costs = CostModel.uniform(p, 1.0, 2.0, 0.25, param_bytes=2**20, activation_bytes=2**18, **links)
    return simulate(method, method.shape(p, None, n), costs)


def test_timeline_bars_rows_and_hover() -> None:
    trace = _trace(latency_s=0.1)
    fig = timeline_figure(trace)
    names = [t.name for t in fig.data]
    assert names == ["forward", "backward", "update", "send activation", "send gradient"]
    assert sum(len(t.x) for t in fig.data) == len(trace.events)
    rows = list(fig.layout.yaxis.categoryarray)
    assert rows == ["rank 0", "link 0→1", "link 1→0", "rank 1", "link 1→2", "link 2→1", "rank 2"]
    assert "weight version" in fig.data[0].hovertemplate
    forward = fig.data[0]
    hover = {(c[0], c[1]): (c[2], c[3]) for c in forward.customdata}
    assert hover[(0, 1)] == (1, 1)  # 0F1 predicts W^(1), one update away
    assert hover[(0, 2)] == (2, 2)  # steady state: P-1-k = 2 updates away
    small = timeline_figure(trace, max_events=5)
    assert "first 5 of" in small.layout.title.text
    assert sum(len(t.x) for t in small.data) == 5


def test_memory_staleness_and_comparison_figures() -> None:
    traces = {name: _trace(name) for name in ("pipedream", "pipeoptim", "1f1b")}
    mem = memory_figure(traces["pipedream"])
    assert [t.name for t in mem.data] == ["stage 0", "stage 1", "stage 2"]
    metrics = {name: compute_metrics(t) for name, t in traces.items()}
    stale = staleness_figure(metrics["pipedream"])
    assert list(stale.data[0].y) == [2, 1, 0]  # pipedream: staleness P-1-k
    comp = comparison_figure(metrics)
    assert len(comp.data) == 5
    assert list(comp.data[4].y) == [3, 2, 1]  # max weight copies per method


def test_report_is_self_contained(tmp_path: Path) -> None:
    traces = {"pipeoptim": _trace(), "gpipe": _trace("gpipe", n=2)}
    text = render_report(traces, notes=["skipped xyz: because"])
    assert "<script src=" not in text.lower().replace("\n", "")
    assert not re.search(r"<script[^>]+src\s*=\s*['\"]?https?:", text, re.I)
    assert "skipped xyz" in text
    assert len(text) > 1_000_000  # plotly.js is inline
    path = write_report(tmp_path / "r.html", traces)
    assert path.read_text(encoding="utf-8").count("Plotly.newPlot") == 1 + 3 * len(traces)


def _png_rows(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct filtered scanlines) of an 8-bit RGB/RGBA PNG, pure Python."""
    header, idat = png_chunks(path)
    width, height, depth, color = header[:4]
    assert depth == 8 and color in (2, 6)
    raw = zlib.decompress(idat)
    stride = 1 + width * (3 if color == 2 else 4)
    rows = {raw[i : i + stride] for i in range(0, len(raw), stride)}
    return width, height, len(rows)


def test_report_screenshot_in_headless_chromium(tmp_path: Path) -> None:
    browser = Chromium(tmp_path / "profile", window=(1400, 1000), budget_ms=5000)
    traces = {"pipeoptim": _trace(latency_s=0.1), "1f1b": _trace("1f1b", n=2)}
    report = write_report(tmp_path / "report.html", traces)
    png = tmp_path / "shot.png"
    url = report.resolve().as_uri()
    browser.screenshot(url, png, timeout=120)
    assert png.exists()
    width, height, distinct = _png_rows(png)
    assert (width, height) == (1400, 1000)
    assert png.stat().st_size > 30_000  # a blank page is about 6 KB
    assert distinct > 100, "the screenshot is (nearly) blank"
    dom = browser.dom(url, timeout=120)
    # plotly drew every figure: 1 comparison + 3 per run, each with a main SVG
    assert dom.count('class="main-svg"') >= 2 * (1 + 3 * len(traces))
    assert "rank 0" in dom and "link 0→1" in dom


def test_memory_figure_downsamples_but_keeps_peaks() -> None:
    trace = _trace("pipedream", p=3, n=40)
    full = memory_figure(trace)
    small = memory_figure(trace, max_points=20)
    for a, b in zip(full.data, small.data, strict=True):
        assert len(b.y) <= 21 < len(a.y)
        assert max(b.y) == max(a.y)
