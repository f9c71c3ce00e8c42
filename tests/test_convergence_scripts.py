"""The convergence scripts' shared command line refuses a run name it does not know."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "convergence"


@pytest.mark.parametrize("script", ["ablate.py", "attention.py", "heldout.py"])
def test_an_unknown_run_name_is_exit_2_with_the_known_names(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--only", "bogus", "--report-only"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--only names no run of this script: ['bogus']; choose from [" in done.stderr
    assert "Traceback" not in done.stderr
