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
