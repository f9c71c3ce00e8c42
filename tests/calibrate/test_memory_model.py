"""The simulator's memory model against the runtime's own byte counts on real runs.

The runtime counts what each stage holds (weights, stash and predicted copies, gradients,
optimizer state, saved activations) and records every new peak; calibration feeds the
measured sizes to the simulator, which replays the schedule with its model of when each of
those is held. On CPU both sides count the same bytes, so the peaks must agree exactly; a
drift in either model (a copy freed late, gradients kept past an update) shows here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeoptim.calibrate import predict_run
from pipeoptim.cli import main
from pipeoptim.metrics import compute_metrics
from pipeoptim.trace import Trace


@pytest.mark.parametrize(
    ("method", "optimizer"),
    [
        ("gpipe", "sgd"),
        ("1f1b", "adam"),
        ("pipedream", "sgd"),
        ("2bw", "adamw"),
        ("xpipe", "adam"),
        ("pipeoptim", "adam"),
    ],
)
def test_peak_memory_per_stage_is_predicted_exactly(
    method: str, optimizer: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_path = tmp_path / "run.json"
    argv = ["train", "--method", method, "--stages", "3", "--optimizer", optimizer]
    argv += ["--max-steps", "12", "--transport", "local", "--quiet", "--trace", str(trace_path)]
    assert main(argv) == 0, capsys.readouterr().err
    measured = Trace.load(trace_path)
    predicted = predict_run(measured)
    got = compute_metrics(measured).stages
    want = compute_metrics(predicted).stages
    assert set(got) == set(want) == {0, 1, 2}
    for k in got:
        assert got[k].peak_memory_bytes == want[k].peak_memory_bytes, k
    # and the peak is not a trivial one: gradients and optimizer state were held
    top = max(measured.memory, key=lambda m: m.bytes)
    assert top.detail["optimizer"] > 0 and top.detail["weights"] > 0


@pytest.mark.parametrize(
    ("method", "recompute"),
    [("1f1b", "full"), ("pipedream", "full"), ("pipeoptim", "full"), ("pipeoptim", "stages:0")],
)
def test_peak_memory_with_recomputation_is_predicted_exactly(
    method: str, recompute: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Recomputed, a stage keeps less per forward (the trace's F bytes) and a predicting
    stage holds the recomputed units' Ŵ per predicted forward in flight (the trace's
    ``recompute_held_bytes``): the simulator replays both."""
    runs = {}
    for rc in (None, recompute):
        trace_path = tmp_path / f"{rc}.json"
        argv = ["train", "--method", method, "--stages", "3", "--optimizer", "adam"]
        argv += ["--max-steps", "12", "--transport", "local", "--quiet", "--trace", str(trace_path)]
        argv += ["--recompute", rc] if rc else []
        assert main(argv) == 0, capsys.readouterr().err
        measured = Trace.load(trace_path)
        got = compute_metrics(measured).stages
        want = compute_metrics(predict_run(measured)).stages
        for k in got:
            assert got[k].peak_memory_bytes == want[k].peak_memory_bytes, (rc, k)
        runs[rc] = {
            kind: max(m.detail.get(kind, 0) for m in measured.memory if m.rank == 0)
            for kind in ("activations", "stash")
        }
    assert runs[recompute]["activations"] < runs[None]["activations"]
    # the digits MLP's activations at batch 32 are smaller than its weights: recomputed,
    # a predicting stage 0 holds more (Ŵ per forward in flight) than it frees
    more = runs[recompute]["stash"] > runs[None]["stash"]
    assert more == (method == "pipeoptim")
