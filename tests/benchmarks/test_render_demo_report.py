"""benchmarks/render_demo_report.py: the README's picture of the demo, made again. Only what
is cheap runs here (its options, its Chromium command, a render of a tiny saved page); the
demo itself takes minutes and is never run by the tests."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from support import benchmark_scripts


def script() -> Any:
    return benchmark_scripts.load("render_demo_report")


def test_the_defaults_write_the_readmes_picture_from_a_fresh_demo() -> None:
    s = script()
    args = s.parse_args([])
    assert args.out == s.ROOT / "docs" / "demo-report.png" and args.out.is_file()
    assert args.work is None and args.report is None  # a temporary folder, a new demo
    assert args.window == (1400, 2200) and args.budget_ms == 20_000
    assert s.parse_args(["--window", "800x600", "--report", "r.html"]).window == (800, 600)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--window", "wide"], "expected WIDTHxHEIGHT in pixels, e.g. 1400x2200 (got 'wide')"),
        (["--window", "0x10"], "expected WIDTHxHEIGHT"),
        (["--budget-ms", "0"], "--budget-ms must be positive (got 0)"),
        (["--report", "r.html", "--work", "w"], "--report renders a report already made"),
    ],
)
def test_bad_options_are_refused_with_the_rule(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        script().parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_chromium_command_screenshots_the_page_headless_in_its_own_profile(
    tmp_path: Path,
) -> None:
    command = script().chromium_command(
        "/bin/chromium", "file:///r.html", tmp_path / "p.png", tmp_path / "prof", (10, 20), 5
    )
    assert command[0] == "/bin/chromium" and command[-1] == "file:///r.html"
    for flag in ("--headless", "--window-size=10,20", "--virtual-time-budget=5"):
        assert flag in command
    assert f"--screenshot={tmp_path / 'p.png'}" in command
    assert f"--user-data-dir={tmp_path / 'prof'}" in command


PAGE = """<!doctype html><html><body style="margin:0">
{rows}
</body></html>"""


def test_a_saved_page_is_rendered_and_a_blank_one_refused(tmp_path: Path) -> None:
    s = script()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip(
            "NO BROWSER FOUND: render_demo_report needs headless Chromium "
            "(apt-get install -y chromium); the page was not rendered"
        )
    # 150 one-pixel stripes of different greys: 150 distinct rows at least
    stripes = "".join(
        f'<div style="height:1px;background:rgb({i},{255 - i},{i // 2})"></div>' for i in range(150)
    )
    page = tmp_path / "report.html"
    page.write_text(PAGE.format(rows=stripes))
    png = tmp_path / "pictures" / "demo.png"
    s.render(page, png, browser, window=(200, 300), budget_ms=1000, timeout_s=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert s.distinct_rows(png) >= 150
    blank = tmp_path / "blank.html"
    blank.write_text(PAGE.format(rows=""))
    kept = png.read_bytes()
    with pytest.raises(SystemExit, match=r"nearly blank .* was left as it was"):
        s.render(blank, png, browser, window=(200, 300), budget_ms=1000, timeout_s=120)
    assert png.read_bytes() == kept
    with pytest.raises(SystemExit, match="no report at"):
        s.render(tmp_path / "missing.html", png, browser)
