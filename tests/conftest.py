"""Set-up shared by every test folder.

Ranks started by torchrun or by the dist transport load test files and worker scripts by path;
those import ``support``, so the folder that holds it goes on the ``PYTHONPATH`` of every
process the tests start (pytest's ``pythonpath`` reaches this process only)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _share_support_with_started_processes() -> None:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(TESTS) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(TESTS)])


_share_support_with_started_processes()
