"""The commands' refusals: no input exhausts the machine, loses a finished result or ends in
a traceback (work limits, output paths, file fields, broken pipes, unit costs).

``pipeoptim train``'s own cases are in ``test_train_faults.py``; the property-based side is
``test_fuzz.py``.
"""

from __future__ import annotations

import errno
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeoptim.cli import main
from pipeoptim.commands import planning
from pipeoptim.errors import PipeoptimError, WorkLimitError
from pipeoptim.plan.limits import (
    MAX_ACTIONS,
    max_actions,
)
from pipeoptim.plan.methods import METHODS, build_schedule, check_schedule_size, get_method
from pipeoptim.plan.partition import optimal_partition
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.sim import CostModel, compile_method, simulate
from pipeoptim.trace import Trace


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    start = time.perf_counter()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert time.perf_counter() - start < 20, argv
    assert "Traceback" not in out + err
    return code, out, err


def profile_file(tmp_path: Path, layers: int = 8) -> Path:
    path = tmp_path / "profile.json"
    profile = Profile.uniform(
        layers, 0.01, 0.02, activation_bytes=100, param_bytes=1000, batch_size=64
    )  # a batch that P, 2P and 4P micro-batches divide, so the planner tries them all
    profile.save(path)
    return path


# ---------------------------------------------------------------------------- work limits
@pytest.mark.parametrize("stages", ["100000", "1000"])
def test_schedule_size_is_estimated_and_refused(
    capsys: pytest.CaptureFixture[str], stages: str
) -> None:
    code, out, err = run(capsys, "schedule", "--method", "pipeoptim", "--stages", stages)
    assert code == 2 and out == ""
    assert "cells" in err and "the limit is 3,000,000 cells" in err
    assert "Fix: fewer --" in err and "PIPEOPTIM_MAX_ACTIONS" in err


@pytest.mark.parametrize("engine", ["simpy", "fast"])
@pytest.mark.parametrize("method", ["pipeoptim", "all"])
def test_simulate_size_is_estimated_and_refused(
    capsys: pytest.CaptureFixture[str], engine: str, method: str
) -> None:
    code, out, err = run(
        capsys,
        "simulate",
        "--stages",
        "4",
        "--mini-batches",
        "1000000000",
        "--method",
        method,
        "--engine",
        engine,
    )
    assert code == 2 and out == ""
    assert "12,000,000,012 actions" in err  # 4 stages x (2 + 1) actions x N, + 3 per stage
    assert "the limit is 3,000,000 actions" in err
    assert "at most 249,999 fit" in err and "N = 4P = 16" in err


def test_work_estimates_are_exact_for_every_method() -> None:
    for name, method in METHODS.items():
        for p, m, n in [(2, None, None), (3, 6, 3), (4, 8, 2)]:
            v = 3 if method.interleaved else None
            try:
                schedule, shape = build_schedule(name, p, m, n, v)
            except PipeoptimError:
                continue  # the method's own size rules refuse it
            estimate = method.work(shape)
            assert estimate.actions == sum(a is not None for r in schedule.values() for a in r)
            steps = max(len(r) for r in schedule.values())
            if method.v_shape:  # a V's mini-batches overlap: the closed form is a bound
                assert steps <= estimate.steps, name
            else:
                assert estimate.steps == steps, name


def test_benchmark_sizes_still_fit_the_work_limit() -> None:
    """P=64, N=10,000 (benchmarks/bench_sim.py) is within both limits."""
    shape = check_schedule_size("pipeoptim", 64, None, 10_000, what="simulating")
    estimate = get_method("pipeoptim").work(shape)
    assert estimate.actions == 1_920_000 <= MAX_ACTIONS
    assert estimate.grid_cells <= MAX_ACTIONS
    assert check_schedule_size("1f1b", 8, 1_000, 2).micro_batches == 1_000


def test_library_builders_refuse_before_building() -> None:
    method = get_method("pipeoptim")
    shape = method.shape(4, None, 10**9)
    with pytest.raises(WorkLimitError, match="the limit is"):
        build_schedule("pipeoptim", 4, None, 10**9)
    with pytest.raises(WorkLimitError, match="the limit is"):
        compile_method(method, shape)
    with pytest.raises(WorkLimitError, match="the limit is"):
        simulate(method, shape, CostModel.uniform(4))
    with pytest.raises(WorkLimitError, match=r"running pipeoptim with P=4, M=1, N=1,000,000,000"):
        check_schedule_size("pipeoptim", 4, None, 10**9)
    with pytest.raises(WorkLimitError, match="4,000 x 4,000"):
        optimal_partition(Profile.uniform(8_000), 4_001)


def test_work_limit_can_be_moved_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEOPTIM_MAX_ACTIONS", "100")
    assert max_actions() == 100
    with pytest.raises(WorkLimitError, match="the limit is 100 actions"):
        check_schedule_size("gpipe", 4, 4, 4)
    monkeypatch.setenv("PIPEOPTIM_MAX_ACTIONS", "lots")
    with pytest.raises(WorkLimitError, match="PIPEOPTIM_MAX_ACTIONS must be a whole number"):
        max_actions()


def test_plan_search_skips_candidates_over_the_work_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPEOPTIM_MAX_ACTIONS", "600")
    code, out, _ = run(capsys, "plan", "--profile", str(profile_file(tmp_path)), "--stages", "4")
    assert code == 0
    assert "not simulated" in out and "Not simulated (over the work limit" in out


# --------------------------------------------------------------------------- output paths
BAD_OUTPUTS = [
    (["schedule", "--method", "gpipe", "--stages", "2"], "--out"),
    (["simulate", "--stages", "2"], "--html"),
    (["simulate", "--stages", "2"], "--trace"),
    (["simulate", "--stages", "2"], "--chrome-trace"),
    (["plan", "--profile", "{profile}", "--stages", "2"], "--out"),
    (["plan", "--profile", "{profile}", "--stages", "2"], "--html"),
    (["profile", "--model", "mlp"], "--out"),
    (["calibrate", "--trace", "{trace}"], "--html"),
    (["calibrate", "--trace", "{trace}"], "--out-trace"),
    (["calibrate", "--trace", "{trace}"], "--out-profile"),
]


@pytest.fixture
def no_profiling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the torch profiler; the list records every call."""
    calls: list[str] = []

    def fake(model: str, *_: Any, **__: Any) -> Profile:
        calls.append(model)
        return Profile.uniform(4, 0.01, 0.02, activation_bytes=100, param_bytes=1000)

    monkeypatch.setattr(planning, "_profile_model", fake)
    return calls


@pytest.mark.parametrize(("argv", "flag"), BAD_OUTPUTS, ids=lambda x: str(x))
@pytest.mark.parametrize("kind", ["missing folder", "folder", "under a file"])
def test_bad_output_paths_are_refused_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_profiling: list[str],
    argv: list[str],
    flag: str,
    kind: str,
) -> None:
    inputs = {"{profile}": str(profile_file(tmp_path)), "{trace}": str(tmp_path / "nothing")}
    bad = {
        "missing folder": tmp_path / "no" / "such" / "x.json",
        "folder": tmp_path,
        "under a file": tmp_path / "profile.json" / "x.json",
    }[kind]
    code, out, err = run(capsys, *[inputs.get(a, a) for a in argv], flag, str(bad))
    assert code == 2 and out == ""
    assert f"error: {flag} '{bad}'" in err  # names the flag and the path...
    assert "choose another path" in err or "give a file path" in err  # ...and the fix
    assert no_profiling == []  # nothing was measured (checked first, even before inputs)


def test_two_flags_one_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    same = str(tmp_path / "x.json")
    code, _, err = run(capsys, "simulate", "-P", "2", "--trace", same, "--chrome-trace", same)
    assert code == 2 and "--trace and --chrome-trace both write" in err


def test_output_over_an_input_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = str(profile_file(tmp_path))
    code, _, err = run(capsys, "plan", "--profile", profile, "--stages", "2", "--out", profile)
    assert code == 2 and f"--out '{profile}' would overwrite the input --profile" in err
    assert Profile.load(profile).num_layers == 8  # untouched


needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")


@needs_dev_full
def test_failed_write_prints_the_schedule_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, "schedule", "--method", "gpipe", "--stages", "2", "--out", "/dev/full"
    )
    assert code == 2
    assert "0F0" in out  # the grid was printed instead
    assert "not written: /dev/full (No space left on device)" in err


@needs_dev_full
def test_failed_write_prints_the_plan_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys,
        "plan",
        "--profile",
        str(profile_file(tmp_path)),
        "--stages",
        "2",
        "--out",
        "/dev/full",
    )
    assert code == 2
    assert json.loads(out[out.index("{") :])["format"] == "pipeoptim-plan"  # not lost
    assert "not written: /dev/full" in err


@needs_dev_full
def test_failed_write_prints_the_profile_and_says_so(
    capsys: pytest.CaptureFixture[str], no_profiling: list[str]
) -> None:
    code, out, err = run(capsys, "profile", "--model", "mlp", "--out", "/dev/full")
    assert code == 2 and no_profiling == ["mlp"]
    assert '"layers"' in out and "not written: /dev/full" in err


def test_failed_trace_write_keeps_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: Trace, path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Trace, "save", full)
    out_path = tmp_path / "t.json"
    html = tmp_path / "r.html"
    code, out, err = run(
        capsys,
        "simulate",
        "-P",
        "2",
        "--method",
        "gpipe",
        "--trace",
        str(out_path),
        "--html",
        str(html),
    )
    assert code == 2
    assert "gpipe" in out and f"wrote {html}" in out  # the table, and what was written
    assert f"not written: {out_path} (No space left on device)" in err
    code, out, err = run(
        capsys, "simulate", "-P", "2", "--method", "gpipe", "--trace", str(out_path), "--json"
    )
    assert code == 2 and json.loads(out)["not_written"] == [f"{out_path} (No space left on device)"]


# ---------------------------------------------------------------- input files and pipes
def test_binary_schedule_file_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.csv"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    code, _, err = run(capsys, "schedule", "--load", str(path))
    assert code == 2 and f"schedule file '{path}' is not UTF-8 text" in err


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_broken_pipe_ends_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["methods", "--json"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_broken_pipe_in_a_real_pipe() -> None:
    """``pipeoptim ... | head -c 10``: the reader leaves early, the command exits quietly."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeoptim",
            "schedule",
            "--method",
            "pipeoptim",
            "--stages",
            "60",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 2
    assert err == ""


def _plan(**changes: Any) -> dict[str, Any]:
    data = Plan("pipeoptim", 2).to_dict()
    for key, value in changes.items():
        if value is KeyError:
            del data[key]
        elif key == "lr":
            data["optimizer"]["lr"] = value
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"boundaries": "x"},
            'field boundaries must be a list of [start, end] layer ranges or null (got "x")',
        ),
        ({"lr": "fast"}, 'field optimizer.lr must be a number (got "fast")'),
        ({"num_stages": "four"}, 'field num_stages must be a whole number >= 1 (got "four")'),
        ({"num_stages": True}, "field num_stages must be a whole number >= 1 (got true)"),
        ({"method": KeyError}, "is missing the key 'method'"),
        ({"version": 99}, "has version 99; this pipeoptim reads pipeoptim plan version 1"),
    ],
)
def test_plan_fields_are_checked_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], expected: str
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(**changes)))
    code, _, err = run(capsys, "simulate", "--plan", str(path))
    assert code == 2 and expected in err, err
    for internal in ("__init__", "int()", "TypeError", "invalid literal"):
        assert internal not in err


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(events=[1]), "field events[0] must be an object (got 1)"),
        (lambda d: d["events"][0].update(start="soon"), "field events[0].start must be a number"),
        (lambda d: d["events"][0].update(colour=1), "events[0] has the unknown key 'colour'"),
        (lambda d: d.update(version=99), "has version 99"),
        (lambda d: d["meta"].update(mini_batches="many"), "field meta.mini_batches must be"),
        (lambda d: d.update(memory={}), "field memory must be a list"),
    ],
)
def test_trace_fields_are_checked_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, expected: str
) -> None:
    trace = tmp_path / "t.json"
    assert main(["simulate", "-P", "2", "--method", "gpipe", "--trace", str(trace)]) == 0
    data = json.loads(trace.read_text())
    edit(data)
    trace.write_text(json.dumps(data))
    capsys.readouterr()
    code, _, err = run(capsys, "calibrate", "--trace", str(trace))
    assert code == 2 and expected in err, err
    assert "must be a mapping" not in err


def test_profile_fields_are_checked_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = profile_file(tmp_path)
    data = json.loads(path.read_text())
    data["layers"][3]["forward_s"] = "fast"
    data["batch_size"] = True
    path.write_text(json.dumps(data))
    code, _, err = run(capsys, "simulate", "--profile", str(path), "--stages", "2")
    assert code == 2 and "field batch_size must be a whole number >= 1 (got true)" in err
    data["batch_size"] = 8
    path.write_text(json.dumps(data))
    code, _, err = run(capsys, "plan", "--profile", str(path), "--stages", "2")
    assert code == 2 and 'field layers[3].forward_s must be a number >= 0 (got "fast")' in err


def test_latency_error_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "--stages", "4", "--latency", "-1")
    assert code == 2 and "--latency must be a number >= 0 (got -1)" in err
    assert "latency_s" not in err
    with pytest.raises(PipeoptimError, match=r"latency_s of link 0 \(between stages 0 and 1\)"):
        CostModel.uniform(4, latency_s=-1.0)


@pytest.mark.parametrize("command", ["schedule", "simulate"])
@pytest.mark.parametrize("method", ["interleaved-1f1b", "gpipe"])
def test_zero_virtual_stages_error_is_consistent(
    capsys: pytest.CaptureFixture[str], command: str, method: str
) -> None:
    code, _, err = run(
        capsys, command, "--method", method, "--stages", "2", "--virtual-stages", "0"
    )
    assert code == 2 and "at least 1" in err and "(got 0)" in err
    assert "use interleaved-1f1b for several stages per rank" not in err


# ----------------------------------------------------------------------------- unit costs
@pytest.mark.parametrize("uniform", ["0,0", "0,0,0", "-1,2", "1,-2"])
def test_zero_or_negative_uniform_costs_are_refused(
    capsys: pytest.CaptureFixture[str], uniform: str
) -> None:
    code, out, err = run(capsys, "simulate", "--stages", "2", f"--uniform={uniform}")
    assert code == 2 and out == ""
    assert "--uniform" in err and "e.g. --uniform 1,2" in err


def test_zero_profile_costs_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "zero.json"
    Profile.uniform(4, 0.0, 0.0).save(path)
    code, _, err = run(capsys, "simulate", "--stages", "2", "--profile", str(path))
    assert code == 2 and "no throughput" in err and f"--profile {path}" in err
