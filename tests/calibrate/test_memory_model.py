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
