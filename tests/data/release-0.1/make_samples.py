"""Regenerate the files release 0.1 wrote, which later releases must still load.

Why: a refactor may change how plans, profiles, traces and checkpoints are read; these
samples, written by the release before it, are what ``tests/test_release_samples.py``
loads. Regenerate them only with the release they stand for (they are its output, not
the current tree's): check out that release, then run from the repository root

    python tests/data/release-0.1/make_samples.py

It writes, beside this script (about 0.7 MB, most of it the checkpoint):

* ``profile.json``: ``pipeoptim profile --model mlp --batch-size 32`` (the digits MLP, 9 layers);
* ``plan.json``: ``pipeoptim plan`` of that profile, pipeoptim on 2 stages under Adam;
* ``sim_trace.json``: ``pipeoptim simulate --plan plan.json --trace`` (the simulator's Trace);
* ``run_trace.json`` and ``checkpoint/``: ``pipeoptim train --plan plan.json --max-steps 6
  --checkpoint-every 3 --keep-checkpoints 1`` on the local transport (the runtime's Trace,
  and the checkpoint of step 6 with the predictor's and Adam's state in it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

RUN_STEPS = 6
CHECKPOINT_EVERY = 3


def pipeoptim(*args: str, cwd: Path) -> None:
    """Run one ``pipeoptim`` command of this checkout; a failure stops the script."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "pipeoptim", *args], cwd=cwd, env=env, check=True)


def make_samples(out: Path) -> None:
    """Write every sample into ``out`` (replacing the checkpoint folder there)."""
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        pipeoptim("profile", "--model", "mlp", "--batch-size", "32", "--repeats", "3",
                  "--ranks", "1", "--out", "profile.json", cwd=work)  # fmt: skip
        pipeoptim("plan", "--profile", "profile.json", "--stages", "2", "--method",
                  "pipeoptim", "--optimizer", "adam", "--lr", "0.001", "--out", "plan.json",
                  cwd=work)  # fmt: skip
        pipeoptim("simulate", "--plan", "plan.json", "--trace", "sim_trace.json", cwd=work)
        pipeoptim("train", "--plan", "plan.json", "--max-steps", str(RUN_STEPS),
                  "--checkpoint-dir", "checkpoint", "--checkpoint-every", str(CHECKPOINT_EVERY),
                  "--keep-checkpoints", "1", "--trace", "run_trace.json", cwd=work)  # fmt: skip
        (work / "checkpoint" / ".lock").unlink(missing_ok=True)  # the writer's lock, not data
        for name in ("profile.json", "plan.json", "sim_trace.json", "run_trace.json"):
            shutil.copyfile(work / name, out / name)
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
        shutil.copytree(work / "checkpoint", out / "checkpoint")


if __name__ == "__main__":
    make_samples(HERE)
