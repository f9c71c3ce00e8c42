"""Files written by release 0.1 still load through the public paths, and a run resumes.

The samples in ``tests/data/release-0.1/`` are that release's output (``make_samples.py``
there says how they were made). A change that stops reading them breaks every user's saved
plans, profiles, traces and checkpoints, so each is loaded here as a user would load it and
what it holds is checked against what the release wrote.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from pipeoptim.cli import main
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.runtime.checkpoint.store import CheckpointStore, latest_step
from pipeoptim.trace import Trace

SAMPLES = Path(__file__).resolve().parent / "data" / "release-0.1"
CHECKPOINT_STEP = 6
"""The step the sample run wrote its checkpoint at (``make_samples.RUN_STEPS``)."""


def test_the_plan_file_loads_with_its_method_optimizer_and_stages() -> None:
    plan = Plan.load(SAMPLES / "plan.json")
    assert plan.method == "pipeoptim"
    assert plan.num_stages == 2
    assert plan.micro_batches == 1
    assert plan.optimizer.family == "adam"
    assert plan.optimizer.lr == pytest.approx(1e-3)
    assert plan.boundaries == [(0, 4), (4, 9)]
    assert plan.model == "mlp"
    assert plan.stage_graph is not None


def test_the_profile_loads_with_every_layer_of_the_model() -> None:
    profile = Profile.load(SAMPLES / "profile.json")
    assert len(profile.layers) == 9  # the digits MLP: 5 linear layers and 4 activations
    assert profile.batch_size == 32
    assert profile.device == "cpu"
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)


def test_the_simulators_trace_loads_with_one_event_per_action() -> None:
    trace = Trace.load(SAMPLES / "sim_trace.json")
    assert trace.meta["source"] == "sim"
    assert trace.meta["method"] == "pipeoptim"
    assert trace.ranks == [0, 1]
    mini_batches = trace.meta["mini_batches"]
    assert mini_batches == 4
    # Per stage and mini-batch one forward, one backward and one update.
    assert len(trace.events) == 2 * mini_batches * 3
    assert {e.kind for e in trace.events} == {"F", "B", "U"}


def test_the_runtimes_trace_loads_with_its_messages_and_versions() -> None:
    trace = Trace.load(SAMPLES / "run_trace.json")
    assert trace.meta["source"] == "runtime"
    assert trace.meta["method"] == "pipeoptim"
    assert trace.meta["mini_batches"] == CHECKPOINT_STEP
    assert trace.ranks == [0, 1]
    assert len(trace.events) == 60
    kinds = {e.kind for e in trace.events}
    assert {"F", "B", "U", "SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= kinds
    # Stage 0 predicts over one update (s = 1) once its optimizer has state.
    assert max(e.distance for e in trace.events if e.stage == 0 and e.kind == "F") == 1


def test_the_checkpoint_reads_back_with_its_step_and_the_predictors_state() -> None:
    record = latest_step(SAMPLES / "checkpoint")
    assert record is not None
    assert record["step"] == CHECKPOINT_STEP
    assert record["config"]["method"] == "pipeoptim"
    assert record["config"]["optimizer"]["family"] == "adam"
    store = CheckpointStore(SAMPLES / "checkpoint", record["config"], num_stages=2)
    assert store.steps() == [CHECKPOINT_STEP]
    for stage in range(2):
        payload = store.load(CHECKPOINT_STEP, stage, torch.device("cpu"))
        assert payload["stage"] == stage
        assert payload["step"] == CHECKPOINT_STEP
        assert {"module", "optimizer", "predictor", "rng"} <= set(payload["state"])
        assert payload["state"]["optimizer"]["state"], "Adam's moments after 6 updates"


def test_training_resumes_from_the_checkpoint_and_advances_its_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "checkpoint"
    shutil.copytree(SAMPLES / "checkpoint", folder)
    resumed_to = CHECKPOINT_STEP + 2
    code = main(
        ["train", "--plan", str(SAMPLES / "plan.json"), "--max-steps", str(resumed_to),
         "--checkpoint-dir", str(folder), "--checkpoint-every", "2", "--resume"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"steps {CHECKPOINT_STEP}..{resumed_to} (2 mini-batches)" in out
    loss = re.search(r"final loss (\S+),", out)
    assert loss is not None, out
    assert math.isfinite(float(loss.group(1)))
    record = latest_step(folder)
    assert record is not None
    assert record["step"] == resumed_to
