"""``Pipeline`` as a library: a user's model, DataLoader, loss, schedule and precision.

Numbers are compared with plain single-process PyTorch written out in the test (the
synchronous methods) and with the CLI's own run (the same code path, bit for bit).
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim import Pipeline
from pipeoptim.errors import NonFiniteLossError, PipeoptimError, RuntimeConfigError, StageError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.feed import epoch_seed
from pipeoptim.workloads.data import DatasetLoader
from pipeoptim.workloads.gpt import gpt, lm_loss, python_corpus
from pipeoptim.workloads.loader import build_model
from pipeoptim.workloads.train import train

HERE = Path(__file__)


def layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.Linear(6, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 12),
        nn.Tanh(),
        nn.Linear(12, 3),
    ]


def tensors(n: int = 100) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def loader(batch: int = 16, *, shuffle: bool = True, drop_last: bool = False) -> DataLoader:
    return DataLoader(
        TensorDataset(*tensors()), batch_size=batch, shuffle=shuffle, drop_last=drop_last
    )


def sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_synchronous_method_equals_plain_training_with_accumulation() -> None:
    """1F1B with 4 micro-batches, a shuffling DataLoader with a partial last batch, a
    cosine schedule: the same weights as a plain loop with gradient accumulation."""
    epochs, micro = 3, 4
    pipe = Pipeline(
        layers(),
        "1f1b",
        stages=3,
        micro_batches=micro,
        optimizer=sgd,
        scheduler=lambda opt: CosineAnnealingLR(opt, T_max=18),
        device="cpu",
    )
    result = pipe.fit(loader(), epochs=epochs)
    assert result.steps_per_epoch == 6 and result.skipped_samples == 4  # 100 = 6 x 16 + 4

    model = nn.Sequential(*layers())
    opt = sgd(list(model.parameters()))
    sched = CosineAnnealingLR(opt, T_max=18)
    data = loader()
    losses = []
    for epoch in range(epochs):
        torch.manual_seed(epoch_seed(0, epoch))  # what the pipeline does to the loader's order
        for x, y in data:
            if len(x) < 16:
                continue  # the partial last batch is left out
            total = 0.0
            for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro), strict=True):
                loss = F.cross_entropy(model(xs), ys) / micro
                loss.backward()
                total += loss.item()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(total)
    assert result.losses == pytest.approx(losses, abs=1e-5)
    pipelined = [p for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]
    for a, b in zip(pipelined, model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert pipe.stages[0].scheduler is not None
    assert pipe.stages[0].scheduler.last_epoch == 18  # stepped once per update


def test_library_run_equals_the_cli_run_bit_for_bit() -> None:
    cli = train(
        TrainConfig(Plan("pipeoptim", 4, optimizer=OptimizerSpec("sgd", 0.02)), max_steps=50)
    )
    layers_, data = build_model("mlp", 0)
    pipe = Pipeline(layers_, "pipeoptim", stages=4, optimizer=OptimizerSpec("sgd", 0.02), seed=0)
    lib = pipe.fit(
        DatasetLoader(data.train_x, data.train_y, 32, seed=0),
        max_steps=50,
        eval_data=DatasetLoader(data.test_x, data.test_y, 32, shuffle=False),
    )
    assert cli is not None
    assert lib.losses == cli.losses
    assert lib.eval == cli.eval


def test_one_pipeline_across_epochs_and_exact_resume(tmp_path: Path) -> None:
    """Epochs do not drain the pipeline: s stays at P-1-k across the epoch boundary; a run
    stopped at a checkpoint and resumed equals the uninterrupted one bit for bit."""

    def make(ckpt: Path) -> Pipeline:
        return Pipeline(
            layers(),
            "pipeoptim",
            stages=3,
            optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01),
            scheduler=lambda opt: CosineAnnealingLR(opt, T_max=15),
            checkpoint_dir=str(ckpt),
            checkpoint_every=5,
            device="cpu",
        )

    whole = make(tmp_path / "a").fit(loader(), max_steps=15)
    forwards = [e for e in whole.trace.events if e.kind == "F" and e.stage == 0]
    # Steps 5..9 are one segment holding the epoch end at 6; a drain there would give
    # steps 6, 7, 8 the distances 0, 1, 2.
    assert [e.distance for e in forwards if e.mb in (6, 7, 8)] == [1, 2, 2]
    first = make(tmp_path / "b").fit(loader(), max_steps=10)
    rest = make(tmp_path / "b").fit(loader(), max_steps=15, resume=True)
    assert (rest.start_step, rest.end_step) == (10, 15)
    assert first.losses + rest.losses == whole.losses


def test_evaluate_any_batch_sizes_and_state_dict_round_trip() -> None:
    pipe = Pipeline(layers(), "pipedream", stages=3, optimizer=sgd, device="cpu")
    pipe.fit(loader(drop_last=True), epochs=2)
    ev = pipe.evaluate(DataLoader(TensorDataset(*tensors(37)), batch_size=10))
    model = nn.Sequential(*layers())
    model.load_state_dict(
        {
            f"{i}.{name}": t
            for i, unit in enumerate(pipe.units)
            for name, t in unit.state_dict().items()
        }
    )
    x, y = tensors(37)
    with torch.no_grad():
        out = model(x)
    assert ev.samples == 37
    assert ev.loss == pytest.approx(float(F.cross_entropy(out, y)), abs=1e-5)
    assert ev.accuracy == pytest.approx(float((out.argmax(1) == y).float().mean()))
    state = pipe.state_dict()
    other = Pipeline(layers(seed=9), "pipedream", stages=3, optimizer=sgd, device="cpu")
    other.load_state_dict(state)
    assert other.step == pipe.step == 12
    assert other.evaluate(DataLoader(TensorDataset(*tensors(37)), batch_size=10)) == ev


def test_bf16_trains_and_backward_recasts_the_current_weights() -> None:
    pipe = Pipeline(
        layers(), "pipeoptim", stages=3, amp="bf16", optimizer=sgd, device="cpu", log_every=1
    )
    result = pipe.fit(loader(), epochs=6, eval_data=loader(shuffle=False))
    assert result.losses[-1] < 0.7 * result.losses[0]
    assert pipe._boundaries is not None
    assert {b.dtype for b in pipe._boundaries[:-1]} == {torch.bfloat16}  # stages send bf16
    assert all(p.dtype == torch.float32 for p in pipe.stages[0].module.parameters())


def test_loss_and_metric_stay_on_the_device_until_a_log_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No host read per micro-batch: values come back from the device (tolist, item,
    float, int, bool) only at the log points, once for the losses, once for the correct
    counts."""
    batches = list(loader(shuffle=False, drop_last=True))  # a DataLoader reads its own seed
    reads: list[str] = []
    for name in ("tolist", "item", "__float__", "__int__", "__bool__"):
        original = getattr(Tensor, name)

        def counting(self: Tensor, *args: object, _f: object = original, _n: str = name) -> object:
            if not _token_count_on_host(self, _n):
                reads.append(_n)
            return _f(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(Tensor, name, counting)
    pipe = Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd, device="cpu", log_every=4)
    pipe.fit(batches, max_steps=16)
    assert reads == ["tolist"] * (2 * 16 // 4)


def _token_count_on_host(t: Tensor, read: str) -> bool:
    """The mini-batch's counted targets, read where it is a host tensor already (the
    DataLoader's targets, before they move; on a GPU it stays on the device, unread)."""
    return read == "__int__" and t.device.type == "cpu" and t.dtype == torch.int64


# -- bad input --------------------------------------------------------------------------------
def test_wrong_input_shape_names_stage_unit_and_shapes() -> None:
    bad = DataLoader(TensorDataset(torch.randn(32, 7), torch.zeros(32).long()), batch_size=8)
    pipe = Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd, device="cpu")
    with pytest.raises(
        StageError,
        match=r"stage 0, unit 0 \(Linear, expects a last dimension of 6\) rejected its input "
        r"of shape \(2, 7\)",
    ):
        pipe.fit(bad)


def test_units_that_do_not_chain_are_named() -> None:
    broken = layers()
    broken[2] = nn.Linear(15, 16)  # after Linear(6, 16)
    pipe = Pipeline(broken, "gpipe", stages=2, optimizer=sgd, device="cpu")
    with pytest.raises(
        StageError, match=r"stage 0, unit 2 \(Linear, expects a last dimension of 15\).*\(2, 16\)"
    ):
        pipe.fit(loader())


def test_targets_out_of_range_name_the_values() -> None:
    x, _ = tensors()
    bad = DataLoader(TensorDataset(x, torch.full((100,), 7)), batch_size=10)
    pipe = Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd, device="cpu")
    with pytest.raises(StageError, match=r"the loss failed on the first batch.*values 7\.\.7"):
        pipe.fit(bad)


def test_non_scalar_loss_is_refused() -> None:
    pipe = Pipeline(
        layers(),
        "pipeoptim",
        stages=3,
        optimizer=sgd,
        loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"),
        device="cpu",
    )
    with pytest.raises(StageError, match=r"returned \(2,\), not a scalar tensor"):
        pipe.fit(loader())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": lambda ps: "adam"}, "returned str, not a torch.optim.Optimizer"),
        (
            {"optimizer": lambda ps: torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)},
            "not exactly the stage's",
        ),
        ({"optimizer": lambda ps: 1 / 0}, "the optimizer factory raised ZeroDivisionError"),
        ({"scheduler": lambda opt: 1 / 0}, "the scheduler factory raised ZeroDivisionError"),
        (
            {"scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)},
            "ReduceLROnPlateau steps on a validation metric",
        ),
        ({"amp": "fp16", "device": "cpu"}, "amp='fp16' needs a CUDA device"),
        ({"amp": "int8"}, "unknown amp 'int8'"),
        ({"transport": "dist"}, "torchrun --nproc-per-node 3"),
        ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
        ({"targets": "guess"}, "unknown targets 'guess'; use 'send' or 'read'"),
        ({"stages": 0}, "stages must be a positive integer"),
        ({"stages": 8}, "has 7 layers, too few for 8 stages"),
        ({"method": "magic"}, "unknown method 'magic'"),
        (
            {"method": "gpipe", "stages": 2, "micro_batches": 2_000_000},
            "one never-flushed segment .* is about 64,000,016 actions",
        ),
    ],
)
def test_bad_construction_is_refused(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"method": "pipeoptim", "stages": 3, "optimizer": sgd}
    args.update(kwargs)
    with pytest.raises(PipeoptimError, match=match):
        Pipeline(layers(), **args)  # type: ignore[arg-type]


def test_empty_loader_and_bad_batches_are_refused() -> None:
    pipe = Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd, device="cpu")
    with pytest.raises(RuntimeConfigError, match="the training data is empty"):
        pipe.fit([])
    assert pipe.fit(loader(), max_steps=2).end_step == 2  # refused before any work: usable
    with pytest.raises(RuntimeConfigError, match=r"batch 0 of epoch 0 is a Tensor"):
        Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd).fit([torch.ones(4, 6)])
    with pytest.raises(RuntimeConfigError, match=r"has no len\(\)"):
        Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd).fit(b for b in loader())
    with pytest.raises(RuntimeConfigError, match="the evaluation data is empty"):
        Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd).evaluate([])


def test_fit_after_a_failure_is_refused_with_the_way_out(tmp_path: Path) -> None:
    x, y = tensors()
    data = [(x[:8], y[:8]), (x[8:16] * float("nan"), y[8:16])]
    pipe = Pipeline(
        layers(),
        "pipeoptim",
        stages=3,
        optimizer=sgd,
        checkpoint_dir=str(tmp_path),
        device="cpu",
        log_every=1,
    )
    with pytest.raises(
        NonFiniteLossError, match=r"at step 1.*no checkpoint had been written yet"
    ) as stop:
        pipe.fit(data, epochs=1)
    # the measured remedies of the convergence study, for this method and depth
    advice = str(stop.value)
    assert "2 update(s) ahead" in advice and "use 2bw or xpipe" in advice
    assert "--micro-batches 2 or more gives one update" in advice and "fewer stages" in advice
    assert "predicted_backward=True" in advice
    with pytest.raises(
        RuntimeConfigError, match=r"stopped on an error .*resume from .*resume=True"
    ):
        pipe.fit(data, epochs=1)
    assert pipe.trace().events  # what ran is still readable


def test_scheduler_that_cannot_be_queried_falls_back_and_says_so() -> None:
    def factory(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.CyclicLR(opt, 0.01, 0.1, step_size_up=3)

    pipe = Pipeline(layers(), "pipeoptim", stages=3, optimizer=sgd, scheduler=factory, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = pipe.fit(loader(), epochs=1)
    assert any("cannot be queried" in n for n in result.notes)
    assert any("cannot be queried" in str(w.message) for w in caught)
    assert all(math.isfinite(v) for v in result.losses)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_in_the_steady_state_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage on one GPU; torch.cuda.set_sync_debug_mode("error") while segments run,
    lifted only for the log-point reads."""
    flush, segment = Pipeline._flush_metrics, Pipeline._run_segment

    def quiet_flush(self: Pipeline) -> None:
        torch.cuda.set_sync_debug_mode(0)
        try:
            flush(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def strict_segment(self: Pipeline, first: int, steps: int) -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            segment(self, first, steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(Pipeline, "_flush_metrics", quiet_flush)
    monkeypatch.setattr(Pipeline, "_run_segment", strict_segment)
    x, y = tensors()
    batches = [(x[i : i + 16].pin_memory(), y[i : i + 16].pin_memory()) for i in range(0, 96, 16)]
    for method, amp in (("pipeoptim", None), ("pipedream", "bf16"), ("1f1b", None)):
        pipe = Pipeline(layers(), method, stages=3, optimizer=sgd, device="cuda", amp=amp)
        result = pipe.fit(batches, epochs=3)
        assert all(math.isfinite(v) for v in result.losses)


@pytest.mark.slow
def test_gpt_language_model_learns_within_a_cpu_minute() -> None:
    """The built-in character LM through the library, as the CLI's default runs it
    (PipeOptim, 4 stages, AdamW lr 5e-4, batch 32): 250 steps reach a test perplexity of
    16.4 from 98, below the unigram's (about 22), so the model reads its context (400
    steps reach 12.2; 250 take five eighths of their time)."""
    data = python_corpus()
    torch.manual_seed(0)
    pipe = Pipeline(
        gpt(),
        "pipeoptim",
        stages=4,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=5e-4),
        loss_fn=lm_loss,
        device="cpu",
    )
    train_loader = DataLoader(
        TensorDataset(data.train_x, data.train_y), batch_size=32, shuffle=True, drop_last=True
    )
    result = pipe.fit(
        train_loader,
        max_steps=250,
        eval_data=DataLoader(TensorDataset(data.test_x, data.test_y), batch_size=256),
    )
    assert result.eval is not None and result.eval.samples == len(data.test_x)
    assert result.eval.perplexity < 18.5, result.eval
    assert result.train_accuracy is not None  # token accuracy of the last epoch's steps


def test_import_pipeoptim_does_not_import_torch() -> None:
    """`from pipeoptim import Pipeline` loads torch on first use only: planning and
    simulating stay torch-free."""
    code = (
        "import sys, pipeoptim; assert 'torch' not in sys.modules; "
        "from pipeoptim import Pipeline; assert 'torch' in sys.modules; print(Pipeline.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Pipeline"


def test_predicted_backward_needs_a_predicting_method() -> None:
    from pipeoptim.runtime.pipeline import Pipeline

    with pytest.raises(RuntimeConfigError, match="pipedream does not predict"):
        Pipeline([nn.Linear(4, 4), nn.Linear(4, 2)], "pipedream", stages=2, predicted_backward=True)


def test_weights_gone_non_finite_stop_at_the_checkpoint_and_keep_the_last_good_one(
    tmp_path: Path,
) -> None:
    """Each loss is computed before its update, so it stays finite; the 4th update (lr
    scaled by NaN) turns the weights NaN, and the checkpoint after it refuses to save them."""
    from pipeoptim.runtime.checkpoint.store import latest_step

    def overflow(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda j: 1.0 if j < 3 else math.nan)

    x, y = tensors()
    pipe = Pipeline(
        layers(),
        "gpipe",
        stages=2,
        micro_batches=1,
        optimizer=sgd,
        scheduler=overflow,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=2,
        device="cpu",
        log_every=10**6,
    )
    with pytest.raises(
        NonFiniteLossError, match=r"the last good checkpoint \(step 2\).*weights of stage \d"
    ) as stop:
        pipe.fit([(x[:8], y[:8])] * 4, max_steps=4)
    assert stop.value.step == 4
    assert all(math.isfinite(v) for v in pipe.rank_result().losses.values())
    record = latest_step(tmp_path)
    assert record is not None and record["step"] == 2  # the bad weights were not saved
