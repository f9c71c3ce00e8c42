"""Watching a fit: the loggers' files read back with their own readers and checked against the
fit's result, callbacks' hooks and stops, and the errors of bad logger input (issue 35)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import wandb_reader
from torch import nn

from pipeoptim import Callback, JsonlLogger, Pipeline, TensorBoardLogger, WandbLogger
from pipeoptim.cli import build_parser
from pipeoptim.commands.train import build_config
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.observe import CallbackError, logger_from_spec

STAGE_SIGNALS = ("lr", "memory_bytes", "wait_s", "distance", "weight_copies", "updates")
F32 = torch.finfo(torch.float32)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def data(n: int = 24, batch: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g))
        for _ in range(n)
    ]


def as_f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


class Recorder(Callback):
    """Every hook's record, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_fit_start(self, info: Any, pipeline: Any) -> None:
        self.calls.append(("on_fit_start", info))

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        self.calls.append(("on_step_end", info))

    def on_eval_end(self, info: Any, pipeline: Any) -> None:
        self.calls.append(("on_eval_end", info))

    def on_checkpoint(self, info: Any, pipeline: Any) -> None:
        self.calls.append(("on_checkpoint", info))

    def on_fit_end(self, info: Any, pipeline: Any) -> None:
        self.calls.append(("on_fit_end", info))


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        if info.step >= self.step:
            info.request_stop(f"reached {info.step}")


def weights(pipe: Pipeline) -> list[torch.Tensor]:
    return [
        p.detach().clone() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()
    ]


# -- loggers, read back ----------------------------------------------------------------------
def test_tensorboard_event_files_hold_the_fits_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path / "tb")
    pipe = Pipeline(model(), "pipeoptim", stages=2, log_every=4, loggers=[logger])
    result = pipe.fit(data(), max_steps=12, eval_data=data(4), eval_every=8)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert losses == {s: as_f32(v) for s, v in enumerate(result.losses)}
    for k in (0, 1):
        for name in STAGE_SIGNALS:
            assert f"stage{k}/{name}" in tags
        updates = [(e.step, e.value) for e in events.Scalars(f"stage{k}/updates")]
        assert [t for t, _ in updates] == [3, 7, 11]  # every log_every
        # where the loss of t is read, the stages have updated up to t at most (the
        # asynchronous pipeline has mini-batches in flight: 2 stages, one behind)
        assert all(t - 1 <= u <= t + 1 for t, u in updates)
    assert [e.value for e in events.Scalars("stage0/distance")][-1] == 1  # s = P - 1 - k
    assert [e.value for e in events.Scalars("stage1/distance")][-1] == 0
    evals = events.Scalars("eval/loss")
    assert [e.step for e in evals] == [8, 12]
    assert result.eval is not None and evals[-1].value == as_f32(result.eval.loss)
    assert "train/samples_per_s" in tags
    assert "config/text_summary" in events.Tags()["tensors"]


def test_wandb_offline_run_holds_the_fits_scalars_and_configuration(tmp_path: Path) -> None:
    logger = WandbLogger("pipeoptim-test", dir=tmp_path)
    assert logger.mode == "offline"
    pipe = Pipeline(model(), "gpipe", stages=2, log_every=3, loggers=[logger], seed=5)
    result = pipe.fit(data(), max_steps=6)
    assert logger.run_dir is not None
    (run_file,) = logger.run_dir.glob("run-*.wandb")
    rows = wandb_reader.history(wandb_reader.written(run_file))
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert losses == dict(enumerate(result.losses))
    assert [r["step"] for r in rows if "stage1/lr" in r] == [2, 5]
    config = wandb_reader.config(run_file)
    assert config["method"] == "gpipe" and config["seed"] == 5 and config["num_stages"] == 2


def test_jsonl_lines_and_a_file_per_fit_event(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "run.jsonl"
    pipe = Pipeline(model(), "1f1b", stages=2, log_every=2, loggers=[JsonlLogger(path)])
    result = pipe.fit(data(), max_steps=4)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["event"] == "fit_start" and lines[0]["config"]["method"] == "1f1b"
    assert lines[-1] == {"event": "fit_end", "step": 4, "stopped_by": None, "error": None}
    losses = {
        line["step"]: line["values"]["train/loss"]
        for line in lines
        if line["event"] == "scalars" and "train/loss" in line["values"]
    }
    assert losses == dict(enumerate(result.losses))


# -- callbacks -------------------------------------------------------------------------------
def test_hooks_run_in_order_with_the_fits_values(tmp_path: Path) -> None:
    seen = Recorder()
    pipe = Pipeline(
        model(),
        "pipeoptim",
        stages=2,
        log_every=3,
        callbacks=[seen],
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=6,
    )
    result = pipe.fit(data(), max_steps=9, eval_data=data(2), eval_every=6)
    hooks = [h for h, _ in seen.calls]
    assert hooks == [
        "on_fit_start",
        "on_step_end",
        "on_step_end",
        "on_checkpoint",
        "on_eval_end",
        "on_step_end",
        "on_checkpoint",
        "on_eval_end",
        "on_fit_end",
    ]
    steps = [i for h, i in seen.calls if h == "on_step_end"]
    assert [i.step for i in steps] == [2, 5, 8]
    read = {s: v for i in steps for s, v in i.losses.items()}
    assert read == dict(enumerate(result.losses))
    assert all(i.decides and set(i.stages) == {0, 1} for i in steps)
    end = seen.calls[-1][1]
    assert end.step == 9 and end.error is None and end.result is result
    assert [i.step for h, i in seen.calls if h == "on_checkpoint"] == [6, 9]


@pytest.mark.parametrize("method", ["pipeoptim", "gpipe", "xpipe", "pipedream+bounded", "zb-h1"])
def test_a_stop_gives_the_weights_of_max_steps_there(method: str, tmp_path: Path) -> None:
    stopper = StopAt(5)
    pipe = Pipeline(
        model(), method, stages=2, log_every=1, callbacks=[stopper],
        checkpoint_dir=str(tmp_path / "ck"),
    )  # fmt: skip
    result = pipe.fit(data(), epochs=1, eval_data=data(2))
    end = pipe.step
    flushing = method in ("gpipe", "zb-h1")
    assert end == 6 if flushing else 6 <= end <= 7  # the mini-batches in flight drain
    assert result.end_step == end and len(result.losses) == end
    plain = Pipeline(model(), method, stages=2, log_every=1)
    again = plain.fit(data(), max_steps=end, eval_data=data(2))
    assert all(torch.equal(a, b) for a, b in zip(weights(pipe), weights(plain), strict=True))
    assert result.losses == again.losses and result.eval == again.eval
    latest = json.loads((tmp_path / "ck" / "latest.json").read_text())
    assert latest["step"] == end  # checkpointed as an end is


def test_a_stop_at_a_segment_end_and_from_an_evaluation(tmp_path: Path) -> None:
    class StopOnEval(Callback):
        def on_eval_end(self, info: Any, pipeline: Any) -> None:
            info.request_stop("good enough")

    ended = Recorder()
    pipe = Pipeline(model(), "pipeoptim", stages=2, callbacks=[StopOnEval(), ended])
    result = pipe.fit(data(), epochs=1, eval_data=data(2), eval_every=4)
    assert pipe.step == 4 and result.end_step == 4
    assert [h for h, _ in ended.calls].count("on_eval_end") == 1  # no second one at 4
    assert ended.calls[-1][1].stopped_by == "good enough"


def test_a_callback_that_raises_is_named_and_the_checkpoint_stays(tmp_path: Path) -> None:
    class Broken(Callback):
        def on_step_end(self, info: Any, pipeline: Any) -> None:
            if info.step == 6:
                raise ValueError("my metric failed")

    root = tmp_path / "ck"
    pipe = Pipeline(
        model(), "pipeoptim", stages=2, log_every=1, callbacks=[Broken()],
        checkpoint_dir=str(root), checkpoint_every=4,
    )  # fmt: skip
    with pytest.raises(CallbackError, match=r"callback Broken raised in on_step_end: ValueError"):
        pipe.fit(data(), max_steps=10)
    assert json.loads((root / "latest.json").read_text())["step"] == 4
    resumed = Pipeline(model(), "pipeoptim", stages=2, checkpoint_dir=str(root))
    assert resumed.fit(data(), max_steps=8, resume=True).start_step == 4


# -- bad input -------------------------------------------------------------------------------
def test_bad_logger_input_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RuntimeConfigError, match=r"unknown logger 'csv:x'; use one of tensorb"):
        logger_from_spec("csv:x")
    with pytest.raises(RuntimeConfigError, match=r"needs a DIR after the colon"):
        logger_from_spec("tensorboard:")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(RuntimeConfigError, match=r"tensorboard: cannot write to .*a-file/tb"):
        TensorBoardLogger(blocker / "tb")
    with pytest.raises(RuntimeConfigError, match=r"jsonl: cannot write to"):
        JsonlLogger(blocker / "run.jsonl")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeConfigError, match=r"pip install 'pipeoptim\[tensorboard\]'"):
        TensorBoardLogger(tmp_path / "tb")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeConfigError, match=r"pip install 'pipeoptim\[wandb\]'"):
        WandbLogger("project", dir=tmp_path)
    with pytest.raises(RuntimeConfigError, match=r"unknown mode 'cloud'"):
        WandbLogger("project", mode="cloud", dir=tmp_path)


def test_callbacks_that_are_not_callbacks_are_refused() -> None:
    with pytest.raises(RuntimeConfigError, match=r"callbacks\[0\] \(int\) has none of the hooks"):
        Pipeline(model(), "gpipe", stages=2, callbacks=[3])
    with pytest.raises(RuntimeConfigError, match=r"loggers takes a list of callback objects"):
        Pipeline(model(), "gpipe", stages=2, loggers=JsonlLogger("x.jsonl"))  # type: ignore[arg-type]


def test_the_train_commands_log_flag(tmp_path: Path) -> None:
    parser = build_parser()
    for flag, message in [
        ("bogus:x", r"unknown logger 'bogus:x'"),
        ("jsonl:", r"needs a FILE after the colon"),
    ]:
        args = parser.parse_args(["train", "--log", flag])
        with pytest.raises(RuntimeConfigError, match=message):
            build_config(args)
    target = tmp_path / "run.jsonl"
    args = parser.parse_args(["train", "--log", f"jsonl:{target}", "--log", "jsonl:b.jsonl"])
    assert build_config(args).log == (f"jsonl:{target}", "jsonl:b.jsonl")


def test_the_closure_signal_is_the_measurements_median_per_stage() -> None:
    seen = Recorder()
    pipe = Pipeline(model(), "pipeoptim", stages=2, log_every=5, callbacks=[seen])
    probe = pipe.measure_prediction_closure()
    pipe.fit(data(), max_steps=6)  # the last log point is the segment's end
    last = [i for h, i in seen.calls if h == "on_step_end"][-1]
    (summary,) = probe.summary()  # stage 0 predicts; the last stage does not
    assert last.stages[0].closure == summary.median_ratio
    assert last.stages[1].closure is None
