"""The watchdog that ends a spawned rank when its launcher dies, installed before the rank
imports torch (``runtime/comm/parent_watch.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeoptim.runtime.comm import parent_watch


def test_the_watchdog_module_imports_no_torch() -> None:
    probe = "import sys, pipeoptim.runtime.comm.parent_watch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_rank_still_importing_ends_with_its_launcher(tmp_path: Path) -> None:
    # The worker stands for a rank whose imports take long (torch on a loaded machine): it
    # marks that it started, then sleeps where the real one would still be importing.
    marker = tmp_path / "started"
    # It imports the watchdog as the real worker does (launch.py): the copy that already
    # watches, or there would be two watchdogs and two lines.
    (tmp_path / "slow_worker.py").write_text(
        "import pathlib, time\n"
        "from pipeoptim.runtime.comm import parent_watch\n"
        "assert parent_watch._watched, 'the worker imported a second, idle watchdog'\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    err = tmp_path / "err.log"
    launcher_code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        env = dict(os.environ, {parent_watch.LAUNCHER_PID}=str(os.getpid()), RANK="3")
        cmd = [sys.executable, "-m", "pipeoptim.runtime.comm.parent_watch", "slow_worker"]
        child = subprocess.Popen(cmd, env=env, stderr=open({str(err)!r}, "w"))
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    launcher = subprocess.Popen(
        [sys.executable, "-c", launcher_code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the worker module did not start"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        killed = time.monotonic()
        while _alive(child) and time.monotonic() - killed < 15:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed
    finally:
        launcher.kill()
    assert gone_after < 3, f"the rank still ran {gone_after:.1f} s after its launcher died"
    assert err.read_text() == parent_watch.orphan_line(3) + "\n"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which nobody reaps here, counts as gone)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def test_the_start_names_its_one_worker_module() -> None:
    with pytest.raises(SystemExit, match="one module"):
        parent_watch.main([])


def test_a_ranks_line_reaches_the_shared_stderr_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ranks that share their launcher's stderr print at the same moment when one dies; two
    # writes a line (print's text, then its newline) let another rank's line in between.
    writes: list[tuple[int, bytes]] = []

    def record(fd: int, data: bytes) -> int:
        writes.append((fd, bytes(data)))
        return len(data)

    monkeypatch.setattr(os, "write", record)
    parent_watch.write_whole_line("pipeoptim train: rank 0: lost a peer rank (it stopped or died)")
    parent_watch.write_whole_line("Traceback (most recent call last):\n  ...\nValueError: x\n")
    assert writes == [
        (sys.stderr.fileno(), b"pipeoptim train: rank 0: lost a peer rank (it stopped or died)\n"),
        (sys.stderr.fileno(), b"Traceback (most recent call last):\n  ...\nValueError: x\n"),
    ]


def test_a_line_longer_than_one_write_takes_is_written_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken: list[bytes] = []

    def short_writes(fd: int, data: bytes) -> int:
        taken.append(bytes(data[:3]))
        return min(3, len(data))

    monkeypatch.setattr(os, "write", short_writes)
    parent_watch.write_whole_line("rank 1: é")
    assert b"".join(taken) == "rank 1: é\n".encode()


def test_a_stderr_without_a_descriptor_still_gets_the_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    stream = io.StringIO()  # a notebook's stream: fileno() raises io.UnsupportedOperation
    monkeypatch.setattr(sys, "stderr", stream)
    parent_watch.write_whole_line("pipeoptim train: rank 2: stopping")
    assert stream.getvalue() == "pipeoptim train: rank 2: stopping\n"
