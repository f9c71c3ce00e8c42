"""What a resume checks, and what it says.

1. A resume (and ``Pipeline.load_state_dict``) checks everything before it loads anything:
   the optimizer class, the batch size, the method, the split, each stage's weights; a
   refused one names what differs and leaves the Pipeline as it was. Precision may change.
   Checkpoints written before the new keys still resume.
2. A resume from a checkpoint off the drain grid of an asynchronous method says so in the
   result's notes; on the grid (and for a flushing method anywhere) it is bit-exact.
"""

from __future__ import annotations

import itertools
import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.compare import assert_same
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim.cli import main
from pipeoptim.errors import RankFailedError, RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.checkpoint.store import latest_step
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.result import FitResult
from pipeoptim.workloads.train import train

Factory = Callable[[list[Tensor]], torch.optim.Optimizer]


def adam(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def layers(widths: tuple[int, ...] = (6, 16, 16, 3)) -> list[nn.Module]:
    torch.manual_seed(0)
    units: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        units += [nn.Linear(a, b), nn.Tanh()]
    return units[:-1]


def data(batch: int = 16, samples: int = 64) -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)


def pipe(
    ckpt: Path | None,
    *,
    method: str = "pipeoptim",
    optimizer: Factory = adam,
    every: int | None = 2,
    units: list[nn.Module] | None = None,
    **kw: Any,
) -> Pipeline:
    return Pipeline(
        units if units is not None else layers(),
        method,
        stages=3,
        micro_batches=4 if method in ("2bw", "gpipe") else None,
        optimizer=optimizer,
        checkpoint_dir=str(ckpt) if ckpt is not None else None,
        checkpoint_every=every if ckpt is not None else None,
        device="cpu",
        **kw,
    )


def fit(p: Pipeline, *args: Any, **kw: Any) -> FitResult:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resume notes are warned too
        return p.fit(*args, **kw)


def snapshot(p: Pipeline) -> dict[str, Any]:
    """Everything a load could overwrite: weights, optimizer, predictor, RNG, the step."""
    return {
        "step": p.step,
        "stages": {k: _copy(s.state_dict()) for k, s in p.stages.items()},
    }


def _copy(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_copy(v) for v in obj]
    return obj


def assert_untouched(p: Pipeline, before: dict[str, Any]) -> None:
    assert p.state.failed is None  # a refusal changed nothing, so the Pipeline is usable
    assert_same(snapshot(p), before)


# -- 3. the checks a resume makes before it loads anything ------------------------------------
@pytest.mark.parametrize(
    ("saved", "now", "names"),
    [(adam, adamw, ("Adam", "AdamW")), (sgd, adam, ("SGD", "Adam"))],
)
def test_resume_refuses_another_optimizer_class_with_nothing_loaded(
    tmp_path: Path, saved: Factory, now: Factory, names: tuple[str, str]
) -> None:
    fit(pipe(tmp_path, optimizer=saved), data(), max_steps=4)
    other = pipe(tmp_path, optimizer=now)
    before = snapshot(other)
    with pytest.raises(RuntimeConfigError) as err:
        other.fit(data(), max_steps=6, resume=True)
    assert str(err.value) == (
        f"the checkpoint in {tmp_path} is from a different run (optimizer_class: checkpoint "
        f"'{names[0]}', now '{names[1]}'); resume with the same settings, or use another "
        f"--checkpoint-dir (checkpoint_dir=) to start fresh; nothing was loaded"
    )
    assert_untouched(other, before)


def test_resume_refuses_another_batch_size_with_nothing_loaded(tmp_path: Path) -> None:
    """Step 4 at batches of 16 is epoch 1, batch 0; at 8 it would be epoch 0, batch 4. The
    batch size is known once the first batch is read: the refusal comes then, before any
    step and before anything is loaded, and the same Pipeline then resumes exactly."""
    whole = fit(pipe(tmp_path / "whole"), data(16), max_steps=8)
    first = fit(pipe(tmp_path / "run"), data(16), max_steps=4)
    record = latest_step(tmp_path / "run")
    assert record is not None and record["batch_size"] == 16
    resumed = pipe(tmp_path / "run")
    before = snapshot(resumed)
    with pytest.raises(RuntimeConfigError) as err:
        resumed.fit(data(8), max_steps=8, resume=True)
    assert str(err.value) == (
        f"the checkpoint in {tmp_path / 'run'} was written by a run whose batches held 16 "
        f"samples (step 4 was epoch 1, batch 0 there), and this run's data yields batches of "
        f"8: the batch size fixes the data position and each micro-batch's size, so the run "
        f"would not continue; resume with batches of 16 (the DataLoader's batch_size, "
        f"--batch-size), or use another --checkpoint-dir (checkpoint_dir=) to start fresh; "
        f"nothing was loaded"
    )
    assert_untouched(resumed, before)
    rest = fit(resumed, data(16), max_steps=8, resume=True)
    assert (rest.start_step, rest.end_step) == (4, 8)
    assert first.losses + rest.losses == whole.losses  # the same computation: bit for bit


def test_other_data_of_the_same_batch_size_moves_the_data_position_and_says_so(
    tmp_path: Path,
) -> None:
    fit(pipe(tmp_path), data(16), max_steps=4)  # 4 batches per epoch: step 4 is epoch 1
    rest = fit(pipe(tmp_path), data(16, samples=80), max_steps=6, resume=True)
    assert (
        "resumed from step 4, which was epoch 1, batch 0 in the run that wrote the "
        "checkpoint; this data has 5 batches per epoch, so the run continues at epoch 0, "
        "batch 4: it is not the data the checkpoint was trained on"
    ) in rest.notes


def test_precision_may_change_on_resume_in_the_library_and_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: a resume may change the precision (master weights, optimizer state and
    prediction are fp32 under every amp mode). The library refused it; the CLI allowed it."""
    fit(pipe(tmp_path / "lib"), data(), max_steps=4)
    rest = fit(pipe(tmp_path / "lib", amp="bf16"), data(), max_steps=6, resume=True)
    assert (rest.start_step, rest.end_step) == (4, 6)
    assert "resumed from step 4 with changed hyper-parameters: amp None -> bf16" in rest.notes
    assert rest.trace.meta["resumed_with_changes"] == {"amp": [None, "bf16"]}
    cli = ["train", "--quiet", "--checkpoint-dir", str(tmp_path / "cli"), "--json"]
    assert main([*cli, "--max-steps", "4"]) == 0
    capsys.readouterr()
    assert main([*cli, "--max-steps", "6", "--resume", "--amp", "bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("amp None -> bf16" in note for note in out["notes"])


def _as_written_before(folder: Path) -> None:
    """Make a checkpoint folder look as today's main wrote it: the identity with "amp" and
    without "optimizer_class", no batch size, stage states without the optimizer class."""
    record = json.loads((folder / "latest.json").read_text())
    for path in folder.glob("step-*/stage-*.pt"):
        payload = torch.load(path, weights_only=True)
        payload["config"].pop("optimizer_class", None)
        payload["config"]["amp"] = None
        payload.pop("batch_size", None)
        payload["state"].pop("optimizer_class", None)
        torch.save(payload, path)
    record["config"].pop("optimizer_class", None)
    record["config"]["amp"] = None
    record.pop("batch_size", None)
    (folder / "latest.json").write_text(json.dumps(record))


def test_checkpoints_written_before_the_new_keys_resume_and_are_still_checked(
    tmp_path: Path,
) -> None:
    """An old checkpoint resumes with the same settings (bit-exact); SGD's old state into
    Adam, which raised a raw KeyError 'step' after the weights were overwritten, is refused
    by trying it on the optimizer (and putting the optimizer back), with nothing loaded."""
    whole = fit(pipe(tmp_path / "whole", optimizer=sgd), data(), max_steps=8)
    first = fit(pipe(tmp_path / "old", optimizer=sgd), data(), max_steps=4)
    _as_written_before(tmp_path / "old")
    other = pipe(tmp_path / "old", optimizer=adam)
    before = snapshot(other)
    with pytest.raises(RuntimeConfigError) as err:
        other.fit(data(), max_steps=8, resume=True)
    assert str(err.value) == (
        f"cannot resume from the checkpoint of step 4 in {tmp_path / 'old'}: stage 0: the "
        f"saved optimizer state does not fit this stage's Adam (KeyError: 'step'); it was "
        f"saved with another optimizer: build the Pipeline with that one, or start fresh; "
        f"nothing was loaded (stages 1, 2 do not fit either)"
    )
    assert_untouched(other, before)
    rest = fit(pipe(tmp_path / "old", optimizer=sgd), data(), max_steps=8, resume=True)
    assert (rest.start_step, rest.end_step) == (4, 8)
    assert first.losses + rest.losses == whole.losses


@pytest.mark.slow
def test_under_dist_one_ranks_refusal_stops_every_rank(tmp_path: Path) -> None:
    """Each rank checks its own stage's file; a refusal on one rank (here stage 1's optimizer
    state made SGD's) is raised on every rank, instead of rank 0 waiting for rank 1."""

    def config(steps: int, resume: bool = False) -> TrainConfig:
        plan = Plan("pipeoptim", 2, optimizer=OptimizerSpec("adam", 0.01))
        return TrainConfig(
            plan,
            max_steps=steps,
            transport="dist",
            checkpoint_dir=str(tmp_path),
            resume=resume,
            device="cpu",
            timeout=60,
        )

    train(config(2))
    path = tmp_path / "step-00000002" / "stage-1.pt"
    payload = torch.load(path, weights_only=True)
    payload["state"]["optimizer_class"] = "SGD"
    torch.save(payload, path)
    with pytest.raises(RankFailedError) as err:
        train(config(4, resume=True))
    # whichever rank the launcher hears from first: both raise rank 1's refusal
    assert re.match(
        f"rank [01] failed: cannot resume from the checkpoint of step 2 in "
        f"{re.escape(str(tmp_path))}: stage 1: the saved optimizer state is SGD's, but this "
        f"stage's optimizer is Adam",
        str(err.value),
    )
    assert "rank 0 exited with status 1, rank 1 exited with status 1" in str(err.value)
    record = latest_step(tmp_path)
    assert record is not None and record["step"] == 2  # nothing written either


@pytest.fixture
def trained() -> Iterator[dict[str, Any]]:
    p = pipe(None)
    fit(p, data(), max_steps=4)
    yield p.state_dict()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: pipe(None, method="pipedream"),
            "the state was saved by another kind of Pipeline (method: saved 'pipeoptim', here "
            "'pipedream'); build this Pipeline with the saved method and stages to load it, or "
            "load only the weights: pipe.stages[k].module.load_state_dict("
            "state['stages'][k]['module']); nothing was loaded",
        ),
        (
            lambda: pipe(None, units=layers((6, 12, 16, 3))),
            "load_state_dict: stage 0: the saved weights do not fit this stage's layers (other "
            "shapes: 0.weight saved [16, 6], here [12, 6], 0.bias saved [16], here [12]); "
            "they were saved from another model or another split into stages: load a state "
            "saved by a Pipeline of the same layers, stages and boundaries; nothing was "
            "loaded (stage 1 does not fit either)",
        ),
        (
            lambda: pipe(None, optimizer=sgd),
            "load_state_dict: stage 0: the saved optimizer state is Adam's, but this stage's "
            "optimizer is SGD (the optimizer family fixes the state's shape and meaning); "
            "build the Pipeline with an optimizer factory returning Adam (pipeoptim train: "
            "--optimizer adam), or start fresh; nothing was loaded (stages 1, 2 do not fit "
            "either)",
        ),
    ],
    ids=["method", "split", "optimizer"],
)
def test_load_state_dict_checks_everything_before_loading(
    trained: dict[str, Any], build: Callable[[], Pipeline], message: str
) -> None:
    other = build()
    before = snapshot(other)
    with pytest.raises(RuntimeConfigError) as err:
        other.load_state_dict(trained)
    assert str(err.value) == message
    assert_untouched(other, before)


def test_load_state_dict_of_an_old_state_checks_the_stages(
    trained: dict[str, Any],
) -> None:
    """A state saved before the method and the optimizer class were recorded: the stages are
    still checked (here the prediction rule of another optimizer), and the same kind of
    Pipeline takes it."""
    old = {k: _copy(v) for k, v in trained.items() if k not in ("method", "num_stages")}
    for stage in old["stages"].values():
        stage.pop("optimizer_class", None)
    other = pipe(None, optimizer=sgd)
    before = snapshot(other)
    with pytest.raises(RuntimeConfigError, match=r"stage 0: .*'adam' weight predictor"):
        other.load_state_dict(old)
    assert_untouched(other, before)
    same = pipe(None)
    same.load_state_dict(old)
    assert same.step == 4
    assert_same(snapshot(same)["stages"], _copy(trained["stages"]))


def test_a_load_that_fails_part_way_marks_the_pipeline_failed(
    trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What no check foresees (here stage 1's module failing to load) leaves stage 0 loaded:
    the Pipeline then refuses to train on a mix of states."""
    other = pipe(None)

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("disk went away")

    monkeypatch.setattr(other.stages[1].module, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="disk went away"):
        other.load_state_dict(trained)
    assert other.state.failed == "load_state_dict failed part way: RuntimeError: disk went away"
    with pytest.raises(RuntimeConfigError, match=r"stopped on an error .*load_state_dict failed"):
        other.fit(data(), max_steps=6)


# -- 4. resumes off the drain grid ------------------------------------------------------------
def _interrupted(
    tmp_path: Path, method: str, stop: int, every: int | None = 2
) -> tuple[FitResult, FitResult, FitResult, list[str]]:
    """An uninterrupted fit to 12, and one stopped at ``stop`` and resumed to 12; with what
    the resume warned."""
    whole = fit(pipe(tmp_path / "whole", method=method, every=every), data(8), max_steps=12)
    first = fit(pipe(tmp_path / "run", method=method, every=every), data(8), max_steps=stop)
    resumed = pipe(tmp_path / "run", method=method, every=every)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = resumed.fit(data(8), max_steps=12, resume=True)
    assert (rest.start_step, rest.end_step) == (stop, 12)
    return whole, first, rest, [str(w.message) for w in caught]


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream", "2bw"])
def test_off_grid_resume_of_an_asynchronous_method_says_so(tmp_path: Path, method: str) -> None:
    """fit(max_steps=5) drains at 5, which the uninterrupted run (drains at 2, 4, 6...) does
    not: the resumed run differs by that drain, and its result says so."""
    whole, first, rest, warned = _interrupted(tmp_path, method, 5)
    note = (
        "resumed from step 5, which is not a multiple of checkpoint_every=2: the asynchronous "
        f"pipeline ({method}) drained there when that fit ended, and an uninterrupted run "
        "does not, so this run differs from an uninterrupted one by that drain; end fits on "
        "a multiple of checkpoint_every (max_steps, or epochs x steps per epoch) for exact "
        "resumes"
    )
    assert note in rest.notes and note in warned
    assert first.losses + rest.losses != whole.losses  # what the note is about


def test_without_checkpoint_every_the_end_of_a_fit_is_off_the_grid(
    tmp_path: Path,
) -> None:
    _, _, rest, _ = _interrupted(tmp_path, "pipeoptim", 5, every=None)
    assert any(
        "resumed from step 5, where the fit that wrote the checkpoint ended "
        "(checkpoint_every is not set)" in note
        for note in rest.notes
    )


@pytest.mark.parametrize(
    ("method", "stop"),
    [("pipeoptim", 4), ("gpipe", 5), ("gpipe", 4), ("pipedream+bounded", 4)],
)
def test_on_grid_and_flushing_resumes_are_bit_exact_without_a_note(
    tmp_path: Path, method: str, stop: int
) -> None:
    """On the grid the resumed run runs the uninterrupted run's segments; gpipe flushes
    every mini-batch, so a drain anywhere changes nothing."""
    whole, first, rest, warned = _interrupted(tmp_path, method, stop)
    assert first.losses + rest.losses == whole.losses
    assert not [n for n in rest.notes + warned if "resumed from" in n]
    for k, stage in rest_stages(tmp_path / "run").items():
        assert_same(stage, rest_stages(tmp_path / "whole")[k])


def rest_stages(folder: Path) -> dict[int, Any]:
    record = latest_step(folder)
    assert record is not None and record["step"] == 12
    step = folder / f"step-{record['step']:08d}"
    return {k: torch.load(step / f"stage-{k}.pt", weights_only=True)["state"] for k in range(3)}
