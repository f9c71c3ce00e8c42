"""A checkpoint written at one depth resumes at another: weights and optimizer state re-cut by unit.

1. Synchronous methods: 4 stages for 4 steps, then 2 (or 8) stages, equals a run cut at 2 (or
   8) stages from the start, bit for bit: each unit's forward, backward and update are the same
   operations on the same micro-batches whatever stage holds it (the same M). Where the resume
   also changes the micro-batch count, the micro-batches' sums differ in order: to tolerance.
2. Asynchronous methods carry weights and optimizer state exactly and rebuild what their
   schedule holds (predictions, delay correction); the run trains on, and says so.
3. A checkpoint whose units do not fit the model is refused in one line, nothing loaded;
   one written before the parameter names were recorded resumes only at its own cut.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from support.compare import assert_same
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.checkpoint.recut import SavedCut
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.result import FitResult

ASYNCHRONOUS = ("pipeoptim", "pipedream")


def units(widths: tuple[int, ...] = (6, 8, 8, 8, 8, 3)) -> list[nn.Module]:
    """Nine units (five linear layers, four activations): enough for eight stages."""
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        out += [nn.Linear(a, b), nn.Tanh()]
    return out[:-1]


def data() -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] > 0).long()
    order = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=order)


def adam(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def pipe(
    ckpt: Path | None, method: str, stages: int, micro_batches: int | None = 8, **kw: Any
) -> Pipeline:
    return Pipeline(
        kw.pop("layers", None) or units(),
        method,
        stages=stages,
        micro_batches=None if method in ASYNCHRONOUS else micro_batches,
        optimizer=adam,
        scheduler=halving,  # its progress must carry over: the rate halves at steps 2 and 4
        checkpoint_dir=str(ckpt) if ckpt is not None else None,
        checkpoint_every=2 if ckpt is not None else None,
        device="cpu",
        **kw,
    )


def fit(p: Pipeline, steps: int, resume: bool = False) -> FitResult:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resume's notes are warned too
        return p.fit(data(), max_steps=steps, resume=resume)


def model_level(p: Pipeline) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The pipeline's weights and per-parameter optimizer state under model-level names."""
    saved = SavedCut({k: s.state_dict() for k, s in p.stages.items()}, p.parts.bounds)
    return saved.tensors, {name: param.state for name, param in saved.params.items()}


# -- 1. synchronous methods continue exactly ---------------------------------------------------
@pytest.mark.parametrize(("method", "stages"), [("gpipe", 2), ("1f1b", 8), ("gpipe", 8)])
def test_a_synchronous_run_resumed_at_another_depth_equals_one_cut_so_from_the_start(
    tmp_path: Path, method: str, stages: int
) -> None:
    whole_pipe = pipe(None, method, stages)
    whole = fit(whole_pipe, 6)
    first = fit(pipe(tmp_path, method, 4), 4)
    resumed_pipe = pipe(tmp_path, method, stages)
    rest = fit(resumed_pipe, 6, resume=True)
    assert (rest.start_step, rest.end_step) == (4, 6)
    assert first.losses + rest.losses == whole.losses
    assert_same(model_level(resumed_pipe), model_level(whole_pipe))
    assert any("re-cut by unit" in note for note in rest.notes)
    assert not any("start afresh" in note for note in rest.notes)


def tied_units() -> list[nn.Module]:
    """An embedding whose weight the output layer shares, 14 units."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    out: list[nn.Module] = [embed]
    for _ in range(6):
        out += [nn.Linear(8, 8), nn.Tanh()]
    return [*out, head]


def tokens() -> DataLoader[tuple[Tensor, ...]]:
    x = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(5))
    order = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(x, (x + 1) % 10), batch_size=16, shuffle=True, generator=order)


def test_a_tied_weight_travels_under_each_of_its_names(tmp_path: Path) -> None:
    """4 -> 2 stages: the embedding and the output layer are on two stages in both cuts, so
    their two copies' gradients are added by the tie's sum in both: bit for bit. 1 -> 4: on
    one stage autograd adds the two uses' gradients into one tensor, in another order than
    the tie's sum across stages, so the first steps round differently: to tolerance."""

    def run(ckpt: Path | None, stages: int, steps: int, resume: bool = False) -> FitResult:
        p = pipe(ckpt, "gpipe", stages, layers=tied_units())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return p.fit(tokens(), max_steps=steps, resume=resume)

    whole = run(None, 2, 6)
    first, rest = run(tmp_path / "a", 4, 4), run(tmp_path / "a", 2, 6, resume=True)
    assert first.losses + rest.losses == whole.losses
    whole = run(None, 4, 6)
    first, rest = run(tmp_path / "b", 1, 4), run(tmp_path / "b", 4, 6, resume=True)
    torch.testing.assert_close(
        torch.tensor(first.losses + rest.losses), torch.tensor(whole.losses), rtol=1e-5, atol=0
    )


def test_interleaved_chunks_re_cut_onto_another_depth(tmp_path: Path) -> None:
    """interleaved-1f1b, 2 ranks x 2 chunks -> 4 ranks x 2 chunks: the chunks are the cut."""
    whole = fit(pipe(None, "interleaved-1f1b", 4, virtual_stages=2), 6)
    first = fit(pipe(tmp_path, "interleaved-1f1b", 2, virtual_stages=2), 4)
    rest = fit(pipe(tmp_path, "interleaved-1f1b", 4, virtual_stages=2), 6, resume=True)
    assert first.losses + rest.losses == whole.losses


def test_another_micro_batch_count_continues_to_tolerance(tmp_path: Path) -> None:
    """4 stages at M = 4, then 2 stages at M = 8, against 2 stages at M = 8 throughout: the
    micro-batch means are summed in another grouping, so only float32's rounding differs."""
    whole_pipe = pipe(None, "gpipe", 2, micro_batches=8)
    whole = fit(whole_pipe, 6)
    first = fit(pipe(tmp_path, "gpipe", 4, micro_batches=4), 4)
    resumed_pipe = pipe(tmp_path, "gpipe", 2, micro_batches=8)
    rest = fit(resumed_pipe, 6, resume=True)
    torch.testing.assert_close(
        torch.tensor(first.losses + rest.losses), torch.tensor(whole.losses), rtol=1e-5, atol=0
    )
    ours, theirs = model_level(resumed_pipe)[0], model_level(whole_pipe)[0]
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6)


# -- 2. asynchronous methods carry the state and rebuild the schedule's -----------------------
@pytest.mark.parametrize(
    ("method", "stages"), [("pipeoptim", 2), ("pipeoptim", 8), ("pipedream", 2)]
)
def test_an_asynchronous_run_resumes_at_another_depth_and_trains(
    tmp_path: Path, method: str, stages: int
) -> None:
    writer = pipe(tmp_path, method, 4)
    fit(writer, 4)
    at_checkpoint = model_level(writer)
    resumed_pipe = pipe(tmp_path, method, stages)
    unmoved = fit(resumed_pipe, 4, resume=True)  # resumes at step 4 and runs nothing
    assert (unmoved.start_step, unmoved.end_step) == (4, 4)
    assert_same(model_level(resumed_pipe), at_checkpoint)
    rest = fit(resumed_pipe, 8)
    assert rest.end_step == 8 and len(rest.losses) == 4
    assert all(torch.isfinite(torch.tensor(rest.losses)))
    assert any("start afresh" in note for note in unmoved.notes)


# -- 3. what cannot be re-cut is refused, nothing loaded ---------------------------------------
def test_units_that_do_not_fit_are_refused_in_one_line_with_nothing_loaded(
    tmp_path: Path,
) -> None:
    fit(pipe(tmp_path, "gpipe", 4), 4)
    other = pipe(tmp_path, "gpipe", 2, layers=units((6, 8, 9, 8, 8, 3)))
    before = model_level(other)
    with pytest.raises(RuntimeConfigError) as err:
        fit(other, 6, resume=True)
    assert "\n" not in str(err.value)
    assert str(err.value) == (
        f"the checkpoint in {tmp_path} is from a different run (unit 2: checkpoint "
        f"['Linear', [[8, 8], [8]]], now ['Linear', [[9, 8], [9]]] (class, parameter "
        f"shapes)); resume with the same settings, or use another --checkpoint-dir "
        f"(checkpoint_dir=) to start fresh; nothing was loaded"
    )
    assert_same(model_level(other), before)
    assert other.state.failed is None


def test_a_checkpoint_with_more_units_than_the_model_is_refused(tmp_path: Path) -> None:
    fit(pipe(tmp_path, "gpipe", 4), 4)
    fewer = units()[:7]
    with pytest.raises(RuntimeConfigError, match=r"units: the checkpoint has 9, this model 7"):
        fit(pipe(tmp_path, "gpipe", 2, layers=fewer), 6, resume=True)


def test_a_checkpoint_without_parameter_names_resumes_only_at_its_own_cut(
    tmp_path: Path,
) -> None:
    fit(pipe(tmp_path, "gpipe", 4), 4)
    for path in (tmp_path / "step-00000004").glob("stage-*.pt"):
        payload = torch.load(path, weights_only=True)
        del payload["state"]["param_names"]
        torch.save(payload, path)
    with pytest.raises(RuntimeConfigError, match="before pipeoptim recorded its optimizer's"):
        fit(pipe(tmp_path, "gpipe", 2), 6, resume=True)
    rest = fit(pipe(tmp_path, "gpipe", 4), 6, resume=True)
    assert rest.start_step == 4 and len(rest.losses) == 2
