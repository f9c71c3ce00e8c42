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


def test_the_study_trains_a_part_a_depth_at_a_time_and_refuses_a_depth_it_lacks() -> None:
    """``run.py --stages`` picks depths of the study's own, for a part; others are refused."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "convergence"))
    try:
        import run
    finally:
        sys.path.pop(0)
    config = run.STUDIES["gpt-deep"]
    assert run.depths(config, None) == config.stages
    assert run.depths(config, "16,8") == (16, 8)
    with pytest.raises(SystemExit, match=r"gpt-deep trains at \[8, 16, 4\] stages"):
        run.depths(config, "32")
