"""The README's picture of the demo, made again from the current code: ``docs/demo-report.png``.

Run from the repository root::

    .venv/bin/python benchmarks/render_demo_report.py                  # the demo, then the picture
    .venv/bin/python benchmarks/render_demo_report.py --report R.html  # render a report made before

It runs ``pipeoptim demo`` with its defaults (the digits MLP on 4 stages, as a newcomer's
first command does) into a temporary folder (``--work`` keeps it; a finished demo there is
reused, as the demo resumes), prints the demo's own summary (the numbers the README and
docs/demo-report.md quote), then renders its ``report.html`` with headless Chromium to
``--out`` (default ``docs/demo-report.png``, 1400 x 2200 pixels: the top of the report, from
the recommendation to the timelines). A nearly blank screenshot (plotly not drawn, the
page not loaded) is refused rather than written over the picture.

Why a script kept here: the picture goes stale with every release that moves the demo's
numbers; this is the one command that makes it again (docs/demo-report.md, "Regenerating
the picture").
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PICTURE = ROOT / "docs" / "demo-report.png"
WINDOW = (1400, 2200)
"""The picture's size in pixels (width, height), the README's since the first picture."""
BUDGET_MS = 20_000
"""Virtual time the page's scripts get before the screenshot (plotly draws every figure)."""
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",  # as root in a container
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-background-networking",  # the report opens offline
    "--disable-component-update",
    "--disable-sync",
)
DISTINCT_ROWS = 100
"""Fewer distinct pixel rows than this: the page is (nearly) blank."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PICTURE, help="the PNG to write")
    parser.add_argument(
        "--work", type=Path, default=None, help="the demo's folder (default: a temporary one)"
    )
    parser.add_argument(
        "--report", type=Path, default=None, help="render this report.html; run no demo"
    )
    parser.add_argument("--browser", default=None, help="Chromium's path (default: on PATH)")
    parser.add_argument(
        "--window",
        type=window_size,
        default=WINDOW,
        help=f"WIDTHxHEIGHT in pixels (default {WINDOW[0]}x{WINDOW[1]})",
    )
    parser.add_argument(
        "--budget-ms", type=int, default=BUDGET_MS, help="virtual time for the page's scripts"
    )
    args = parser.parse_args(argv)
    if args.report is not None and args.work is not None:
        parser.error("--report renders a report already made; --work names a demo to run")
    if args.budget_ms <= 0:
        parser.error(f"--budget-ms must be positive (got {args.budget_ms})")
    return args


def window_size(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` as two positive integers."""
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or not int(width) * int(height):
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxHEIGHT in pixels, e.g. 1400x2200 (got {text!r})"
        )
    return int(width), int(height)


def find_browser(explicit: str | None) -> str:
    """Chromium's path, or an error that says how to get it."""
    for name in (explicit,) if explicit else BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit(
        "render_demo_report: no headless Chromium found"
        + (f" at {explicit!r}" if explicit else f" (looked for {', '.join(BROWSERS)})")
        + "; install it (apt-get install -y chromium) or pass --browser PATH"
    )


def chromium_command(
    browser: str,
    url: str,
    png: Path,
    profile: Path,
    window: tuple[int, int] = WINDOW,
    budget_ms: int = BUDGET_MS,
) -> list[str]:
    """The command that screenshots ``url`` into ``png`` (a profile of its own)."""
    return [
        browser,
        *FLAGS,
        f"--window-size={window[0]},{window[1]}",
        f"--virtual-time-budget={budget_ms}",
        f"--user-data-dir={profile}",
        f"--screenshot={png}",
        url,
    ]


def distinct_rows(png: Path, enough: int | None = None) -> int:
    """How many different pixel rows an 8-bit RGB(A) PNG has (few: a blank page), counting
    no further than ``enough``. The scanlines are unfiltered first: filtered, a smooth
    gradient's rows all read alike."""
    data = png.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{png} is not a PNG")
    pos, idat, width, channels = 8, b"", 0, 3
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, channels = int.from_bytes(body[:4], "big"), 4 if body[9] == 6 else 3
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    previous = bytearray(stride)
    rows: set[bytes] = set()
    for start in range(0, len(raw), stride + 1):
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            line[i] = (line[i] + _predictor(kind, left, up, corner)) & 0xFF
        rows.add(bytes(line))
        if enough is not None and len(rows) >= enough:
            break
        previous = line
    return len(rows)


def _predictor(kind: int, left: int, up: int, corner: int) -> int:
    """PNG's filter predictors (none, sub, up, average, Paeth)."""
    if kind == 0:
        return 0
    if kind == 1:
        return left
    if kind == 2:
        return up
    if kind == 3:
        return (left + up) // 2
    guess = left + up - corner
    near = min(
        (abs(guess - left), 0, left), (abs(guess - up), 1, up), (abs(guess - corner), 2, corner)
    )
    return near[2]


def render(
    report: Path,
    png: Path,
    browser: str,
    window: tuple[int, int] = WINDOW,
    budget_ms: int = BUDGET_MS,
    timeout_s: float = 180,
) -> Path:
    """Screenshot ``report`` into ``png``: written only where the page was drawn."""
    if not report.is_file():
        raise SystemExit(f"render_demo_report: no report at {report}; run pipeoptim demo first")
    with tempfile.TemporaryDirectory(prefix="demo-picture-") as scratch:
        shot = Path(scratch) / "shot.png"
        command = chromium_command(
            browser, report.resolve().as_uri(), shot, Path(scratch) / "profile", window, budget_ms
        )
        subprocess.run(command, check=True, capture_output=True, timeout=timeout_s)
        if not shot.is_file():
            raise SystemExit(f"render_demo_report: {browser} wrote no screenshot")
        rows = distinct_rows(shot, enough=DISTINCT_ROWS)
        if rows < DISTINCT_ROWS:
            raise SystemExit(
                f"render_demo_report: the screenshot is nearly blank ({rows} distinct pixel "
                f"rows, fewer than {DISTINCT_ROWS}); {png} was left as it was; give the "
                f"page's scripts more time (--budget-ms)"
            )
        png.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, png)
    return png


def run_demo(work: Path) -> Path:
    """``pipeoptim demo`` with its defaults into ``work``; its summary printed; the report."""
    command = [sys.executable, "-m", "pipeoptim", "demo", "--out", str(work)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    return work / "report.html"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    browser = find_browser(args.browser)
    if args.report is not None:
        report = args.report
        render(report, args.out, browser, args.window, args.budget_ms)
    elif args.work is not None:
        report = run_demo(args.work)
        render(report, args.out, browser, args.window, args.budget_ms)
    else:
        with tempfile.TemporaryDirectory(prefix="pipeoptim-demo-") as work:
            report = run_demo(Path(work))
            render(report, args.out, browser, args.window, args.budget_ms)
    print(f"picture: {args.out} (from {report})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
