"""``pipeoptim demo``: one ``--quick`` run (module fixture) checked section by section, its
resume, a screenshot of its report in headless Chromium, and the bad inputs.

The quick run trains two methods for real (2 processes each over gloo), so it is the slow
part; every test of its outputs shares it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.headless_chromium import Chromium, png_chunks

from pipeoptim.cli import main
from pipeoptim.demo.report import SECTIONS

STEPS = ("profile", "plan", "train", "calibrate", "converge", "report")


@dataclass
class Run:
    out: Path
    code: int
    stdout: str
    stderr: str
    seconds: float


def _demo(out: Path, *flags: str) -> Run:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pipeoptim", "demo", "--quick", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return Run(out, done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = _demo(tmp_path_factory.mktemp("demo") / "out")
    assert run.code == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
def test_quick_demo_prints_the_summary_and_the_report_path(quick: Run) -> None:
    out = quick.stdout
    assert "Traceback" not in out + quick.stderr
    head = out.splitlines()[0].split()
    assert head[:3] == ["method", "role", "M"]
    assert "recommended" in out and "rival" in out
    assert re.search(r"^Run \S+ on 2 stages", out, re.M)  # the recommendation sentence
    last = out.strip().splitlines()[-1]
    assert last == f"report: {quick.out / 'report.html'}"
    assert (quick.out / "report.html").is_file()
    for step in STEPS:  # one line per step as it starts and as it ends, on stderr
        assert re.search(rf"\[\d/6\] {step}\S*: done in", quick.stderr), step


@pytest.mark.slow
def test_quick_demo_report_has_every_section_offline(quick: Run) -> None:
    page = (quick.out / "report.html").read_text(encoding="utf-8")
    for section in SECTIONS:
        assert f"<section id='{section}'>" in page, section
    assert not re.search(r"<script[^>]+src\s*=", page, re.I)  # plotly.js is inline
    assert len(page) > 1_000_000
    figures = sorted((quick.out / "figures").glob("*.json"))
    assert page.count("Plotly.newPlot") == len(figures)
    names = {f.stem for f in figures}
    assert {"methods", "memory-per-stage", "distance-per-stage", "calibration-errors"} <= names
    assert {"loss-vs-samples", "loss-vs-time"} <= names
    assert sum(n.startswith("timeline-") for n in names) == 2
    for needle in ("The planner's reasoning", "its own measured costs, simulated", "zb-h1"):
        assert needle in page


@pytest.mark.slow
def test_quick_demo_every_figure_json_parses_and_has_data(quick: Run) -> None:
    for path in sorted((quick.out / "figures").glob("*.json")):
        fig = json.loads(path.read_text(encoding="utf-8"))
        traces = fig["data"]
        assert traces, path.name
        points = [t for t in traces if len(t.get("y", t.get("x", []))) > 0]
        assert points, f"{path.name}: no trace has data"
        assert fig["layout"]["title"]["text"], path.name


@pytest.mark.slow
def test_quick_demo_writes_each_step_result_and_the_run_files(quick: Run) -> None:
    steps = {p.stem: json.loads(p.read_text()) for p in (quick.out / "steps").glob("*.json")}
    plan = steps["plan"]["result"]
    trained = [plan["recommended"], plan["rival"]]
    assert plan["rival"] in ("zb-h1", "1f1b") and plan["recommended"] != plan["rival"]
    expected = {"profile", "plan", "calibrate", "report"}
    expected |= {f"{s}-{m}" for s in ("train", "converge") for m in trained}
    assert set(steps) == expected
    for record in steps.values():
        assert len(record["fingerprint"]) == 16 and record["inputs"]["stages"] == 2
    for m in trained:
        for name in (f"trace-{m}.json", f"predicted-{m}.json", f"plan-{m}.json"):
            assert (quick.out / name).is_file(), name
        run = steps[f"train-{m}"]["result"]
        assert run["steps"] == 16 and len(run["losses"]) == 16
        assert steps[f"converge-{m}"]["result"]["curve"]
    assert not list(quick.out.rglob(".*"))  # no temporary left behind


@pytest.mark.slow
def test_rerun_skips_the_finished_steps_and_reruns_what_is_missing(quick: Run) -> None:
    report = quick.out / "report.html"
    before = report.stat().st_mtime_ns
    again = _demo(quick.out)
    assert again.code == 0, again.stderr[-2000:]
    assert "done in" not in again.stderr
    assert again.stderr.count(": skipped, steps/") == len(list((quick.out / "steps").iterdir()))
    assert report.stat().st_mtime_ns == before
    assert "resumed:" in again.stdout and again.stdout.strip().endswith("report.html")
    # an interruption during the convergence runs: the steps after it are missing
    plan = json.loads((quick.out / "steps" / "plan.json").read_text())["result"]
    (quick.out / "steps" / f"converge-{plan['rival']}.json").unlink()
    (quick.out / "steps" / "report.json").unlink()
    resumed = _demo(quick.out)
    assert resumed.code == 0, resumed.stderr[-2000:]
    ran = re.findall(r"\] (\S+): done in", resumed.stderr)
    assert ran == [f"converge-{plan['rival']}", "report"]
    assert "[3/6] train-" in resumed.stderr and "skipped" in resumed.stderr


@pytest.mark.slow
def test_a_changed_input_reruns_its_step(quick: Run) -> None:
    """A result file whose fingerprint does not match the inputs is not trusted."""
    record_path = quick.out / "steps" / "report.json"
    record = json.loads(record_path.read_text())
    record["fingerprint"] = "0" * 16
    record_path.write_text(json.dumps(record))
    again = _demo(quick.out)
    assert again.code == 0
    assert re.findall(r"\] (\S+): done in", again.stderr) == ["report"]


@pytest.mark.slow
def test_json_output_holds_the_summary_and_every_step_result(quick: Run) -> None:
    run = _demo(quick.out, "--json")
    assert run.code == 0, run.stderr[-2000:]
    data = json.loads(run.stdout)
    assert data["report"] == str(quick.out / "report.html")
    assert [row["role"] for row in data["summary"]] == ["recommended", "rival"]
    assert {s["how"] for s in data["steps"]} == {"skipped"}
    assert set(data["results"]) == {
        "options", "profile", "plan", "train", "train_steps", "calibrate", "converge"
    }  # fmt: skip
    assert data["results"]["train_steps"] == 16  # --quick trains a fixed count
    assert "report.html" in data["files"] and "steps/plan.json" in data["files"]


@pytest.mark.slow
def test_bench_demo_repeat_trains_the_demos_plans_again_on_its_folder(
    quick: Run, tmp_path: Path
) -> None:
    """benchmarks/bench_demo_repeat.py on a finished demo: no step reruns, both plans train
    again, and each rate is set against the plan's offline prediction."""
    out = tmp_path / "demo"
    shutil.copytree(quick.out, out)  # the other tests read the fixture's folder
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_demo_repeat.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done in" not in done.stderr  # the demo's steps were current: none ran again
    plan = json.loads((out / "steps" / "plan.json").read_text())["result"]
    offline = {r["method"]: r["samples_per_s"] for r in plan["methods"]}
    repeats = re.findall(
        r"^repeat 1: (\S+) +([\d,]+) samples/s, offline ([\d,]+) \(([+-]\d+)%\)$",
        done.stdout,
        re.MULTILINE,
    )
    assert [r[0] for r in repeats] == [plan["recommended"], plan["rival"]], done.stdout
    for method, rate, predicted, error in repeats:
        measured = float(rate.replace(",", ""))
        assert predicted == f"{offline[method]:,.0f}" and measured > 0
        assert abs(round(100 * (offline[method] / measured - 1)) - int(error)) <= 1
        assert re.search(rf"^{method}: median .* spread 1\.00x; .* of 1$", done.stdout, re.M)
    pair = f"{plan['recommended']} / {plan['rival']}: measured"
    assert re.search(rf"^{pair} \d+\.\d\dx", done.stdout, re.M), done.stdout


@pytest.mark.slow
def test_an_interrupted_demo_keeps_its_finished_steps_and_resumes(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group) during the second real run: the first
    one's step is kept, so the resume trains for real once."""
    out = tmp_path / "out"
    # A shell without job control starts background jobs with SIGINT ignored, which a child
    # inherits (and Python then installs no KeyboardInterrupt handler); a handler of ours is
    # not inherited, so the demo starts with SIGINT at its default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeoptim", "demo", "--quick", "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 300
    while not any((out / "steps").glob("train-*.json")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)  # the second real run is starting its processes
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    kept = sorted(p.stem for p in (out / "steps").glob("*.json"))
    assert {"profile", "plan"} <= set(kept) and "report" not in kept
    assert len([k for k in kept if k.startswith("train-")]) == 1, kept
    assert f"interrupted: {len(kept)} finished step(s) are kept in {out}" in err
    assert err.strip().endswith("pipeoptim demo: interrupted")
    resumed = _demo(out)
    assert resumed.code == 0, resumed.stderr[-2000:]
    skipped = re.findall(r"\] (\S+): skipped", resumed.stderr)
    assert sorted(skipped) == kept
    assert (out / "report.html").is_file()


# --------------------------------------------------------------------------- screenshot
def _decode_png(path: Path) -> np.ndarray:
    """An 8-bit RGB/RGBA PNG as a (height, width, channels) array: inflate, then undo each
    scanline's filter (numpy for None/Sub/Up, Python for Average/Paeth)."""
    header, idat = png_chunks(path)
    width, height, depth, color = header[:4]
    assert depth == 8 and color in (2, 6) and header[6] == 0  # 8-bit, not interlaced
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, -1)
    out = np.zeros((height, width * bpp), dtype=np.int64)
    prior = np.zeros(width * bpp, dtype=np.int64)
    for y in range(height):
        kind, line = int(raw[y, 0]), raw[y, 1:].astype(np.int64)
        if kind == 0:
            row = line
        elif kind == 1:
            row = line.reshape(width, bpp).cumsum(axis=0).reshape(-1) % 256
        elif kind == 2:
            row = (line + prior) % 256
        else:
            up, filt, cur = prior.tolist(), line.tolist(), [0] * (width * bpp)
            for i in range(width * bpp):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if kind == 3:
                    cur[i] = (filt[i] + ((a + b) >> 1)) & 255
                    continue
                c = up[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (filt[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            row = np.array(cur, dtype=np.int64)
        out[y] = prior = row
    return out.reshape(height, width, bpp)[:, :, :3]


def _count(pixels: np.ndarray, hex_color: str) -> int:
    rgb = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    return int((pixels == rgb).all(axis=-1).sum())


@pytest.mark.slow
def test_report_screenshot_shows_the_plots_drawn(quick: Run, tmp_path: Path) -> None:
    browser = Chromium(tmp_path / "profile", window=(1400, 2200), budget_ms=8000)
    png = tmp_path / "demo.png"
    url = (quick.out / "report.html").resolve().as_uri()
    browser.screenshot(url, png, timeout=180)
    pixels = _decode_png(png)
    assert pixels.shape[:2] == (2200, 1400)
    flat = pixels.reshape(-1, 3)
    colours = np.unique(flat[:, 0] * 65536 + flat[:, 1] * 256 + flat[:, 2])
    assert len(colours) > 500, "the screenshot is (nearly) flat"
    assert (flat < 235).any(axis=1).mean() > 0.15, "the screenshot is mostly white"
    # plotly drew its plot areas (its default #E5ECF6 background) with bars in the
    # methods' colours on them, not empty frames
    assert _count(pixels, "#E5ECF6") > 100_000, "no plot area was drawn"
    for bar in ("#4C78A8", "#F58518", "#54A24B", "#E45756"):
        assert _count(pixels, bar) > 2_000, f"no bars of colour {bar}"
    dom = browser.dom(url, timeout=180)
    figures = len(list((quick.out / "figures").glob("*.json")))
    assert dom.count('class="main-svg"') >= 2 * figures  # each figure: plot and hover layer
    assert "rank 0 measured" in dom and "rank 1 simulated" in dom


# --------------------------------------------------------------------------- bad input
def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["demo", *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipeoptim demo: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_unknown_model_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _refused(capsys, "--model", "resnet9000", "--out", str(tmp_path / "o"))
    assert "unknown model 'resnet9000'" in line and "module:factory" in line
    assert not (tmp_path / "o").exists()  # nothing was started


@pytest.mark.parametrize(
    ("stages", "needle"),
    [("0", "--stages must be at least 1 (got 0)"), ("99", "at most 16"), ("12", "layers (9)")],
)
def test_bad_stage_counts_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, stages: str, needle: str
) -> None:
    line = _refused(capsys, "--stages", stages, "--out", str(tmp_path / "o"))
    assert needle in line


def test_out_that_is_a_file_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    file = tmp_path / "taken"
    file.write_text("mine")
    line = _refused(capsys, "--out", str(file))
    assert "is a file, not a folder" in line and "--out" in line
    assert file.read_text() == "mine"
