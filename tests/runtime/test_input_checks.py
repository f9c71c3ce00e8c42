"""The checks on the library's inputs: a loss that cannot train is refused at the dry run, a
full disk at the checkpoint pointer is one clean error that keeps the previous checkpoint,
arguments are checked where they are given (no raw TypeError, nothing accepted silently, no
LBFGS, no resume past its end, no fit on a closed dist Pipeline, and three CLI cases), and a
hypothesis fuzz of ``Pipeline``'s constructor and
``fit`` arguments: one ``PipeoptimError`` or success, never another exception.
"""

from __future__ import annotations

import errno
import inspect
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.cli import build_parser, main
from pipeoptim.commands.train import build_config
from pipeoptim.errors import PipeoptimError, RankFailedError, RuntimeConfigError, StageError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.runtime.checkpoint import store as checkpoint
from pipeoptim.runtime.checkpoint.store import latest_step
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.observe import Callback
from pipeoptim.runtime.options import ObserveOptions, PipelineConfig
from pipeoptim.workloads.train import train


def layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)]


def batches(n: int = 4, size: int = 8) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


def weights(pipe: Pipeline) -> list[Tensor]:
    return [p.detach().clone() for s in pipe.stages.values() for p in s.module.parameters()]


# ------------------------------------------------------------ a loss that cannot train
def _detached(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.detach(), target)


def _constant(out: Tensor, target: Tensor) -> Tensor:
    return torch.tensor(1.0)


def _argmax_error(out: Tensor, target: Tensor) -> Tensor:
    return (out.argmax(dim=-1) != target).float().mean()


@pytest.mark.parametrize(
    ("loss_fn", "name"),
    [(_detached, "_detached"), (_constant, "_constant"), (_argmax_error, "_argmax_error")],
)
def test_a_loss_that_does_not_require_grad_is_refused_at_the_dry_run(
    loss_fn: Callable[[Tensor, Tensor], Tensor], name: str
) -> None:
    pipe = Pipeline(layers(), method="pipeoptim", stages=2, loss_fn=loss_fn)
    before = weights(pipe)
    with pytest.raises(StageError) as info:
        pipe.fit(batches(), max_steps=3)
    message = str(info.value)
    assert message.startswith(
        f"stage 1 (the last): the loss {name} returned a tensor that does not require grad"
    )
    assert (
        "so no trainable parameter gets a gradient and training would change no weight" in message
    )
    assert "compute the loss from the output with differentiable operations" in message
    assert all(torch.equal(a, b) for a, b in zip(before, weights(pipe), strict=True))
    assert pipe.step == 0


def test_a_model_without_a_trainable_parameter_is_refused() -> None:
    frozen = layers()
    for unit in frozen:
        unit.requires_grad_(False)
    with pytest.raises(
        StageError,
        match=r"the model has no trainable parameter \(all 4 of its parameters are frozen\)",
    ):
        Pipeline(frozen, method="1f1b", stages=2).fit(batches(), max_steps=2)
    with pytest.raises(StageError, match=r"the model has no trainable parameter \(it has none\)"):
        Pipeline([nn.ReLU(), nn.Identity()], method="gpipe", stages=2).fit(batches(), max_steps=2)


def test_an_integer_output_is_refused() -> None:
    class Predict(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.argmax(dim=-1)

    def mismatch(out: Tensor, target: Tensor) -> Tensor:
        return (out != target).float().mean()

    pipe = Pipeline([*layers(), Predict()], stages=2, loss_fn=mismatch)
    with pytest.raises(StageError) as info:
        pipe.fit(batches(), max_steps=2)
    assert str(info.value).startswith(
        "stage 1 (the last): the loss mismatch gets no gradient: the model's output is "
        "torch.int64, which cannot carry one"
    )


def test_the_dry_run_is_no_training_forward() -> None:
    """The units still run under no_grad in the dry run (a module may count its forwards in
    grad mode as training ones, as tests/runtime/test_checkpoint.py's NanAfter does)."""
    seen: list[bool] = []

    class Spy(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(torch.is_grad_enabled())
            return x

    Pipeline([*layers(), Spy()], stages=2).fit(batches(), max_steps=2)
    assert seen == [False, True, True]  # the dry run, then two training forwards


def test_parameter_free_stages_and_frozen_parameters_stay_legal() -> None:
    # a ReLU-only middle stage
    pipe = Pipeline(layers(), method="pipeoptim", stages=3)
    before = weights(pipe)
    pipe.fit(batches(), max_steps=3)
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(pipe), strict=True))
    # the first stage frozen, the last trains; then the last frozen, the first trains
    for frozen in (0, 2):
        units = layers()
        units[frozen].requires_grad_(False)
        Pipeline(units, method="1f1b", stages=3, micro_batches=4).fit(batches(), max_steps=2)
    # a loss that trains to zero gradients is still a loss that trains
    Pipeline(layers(), stages=2, loss_fn=lambda o, t: o.sum() * 0).fit(batches(), max_steps=2)


def test_a_parameter_free_stage_checkpoints(tmp_path: Path) -> None:
    """Found by the fuzz: the finite-weights check before a checkpoint stacked the empty
    parameter list of a ReLU-only stage (a raw RuntimeError)."""
    pipe = Pipeline(layers(), stages=3, checkpoint_dir=str(tmp_path / "c"), checkpoint_every=1)
    assert pipe.fit(batches(), max_steps=2).end_step == 2
    assert latest_step(tmp_path / "c")["step"] == 2  # type: ignore[index]


def test_evaluate_does_not_refuse_but_a_later_fit_does() -> None:
    frozen = layers()
    for unit in frozen:
        unit.requires_grad_(False)
    pipe = Pipeline(frozen, method="pipeoptim", stages=2)
    assert pipe.evaluate(batches()).samples == 32  # evaluating a frozen model is fine
    with pytest.raises(StageError, match="depends on no trainable parameter"):
        pipe.fit(batches(), max_steps=2)


_DETACHED_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn
from pipeoptim.workloads.data import Dataset

def net():
    return [nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)]

def dataset():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(60, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return Dataset("toy", x[:48], y[:48], x[48:], y[48:], 3)

def loss(out, target):
    return F.cross_entropy(out.detach(), target)
"""


@pytest.mark.slow
def test_under_dist_every_rank_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0's rank probes; its refusal reaches the last stage's rank too (which fails
    with the same message, not killed), and nothing trains."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tmp_path / "detached_model.py"
    model.write_text(_DETACHED_MODEL)
    plan = Plan(
        "pipeoptim", 2, optimizer=OptimizerSpec("sgd", 0.1), model=f"{model}:net", batch_size=12
    )
    config = TrainConfig(plan, transport="dist", device="cpu", timeout=60, max_steps=2)
    with pytest.raises(RankFailedError) as info:
        train(config)
    message = str(info.value)
    assert "the loss loss returned a tensor that does not require grad" in message
    assert "rank 0 exited with status 1, rank 1 exited with status 1" in message


# ---------------------------------------------------- a full disk at the checkpoint pointer
def test_a_full_disk_at_the_pointer_is_one_error_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    pipe = Pipeline(
        layers(), method="pipeoptim", stages=2, checkpoint_dir=str(root), checkpoint_every=2
    )
    pipe.fit(batches(), max_steps=2)
    pointer = root / "latest.json"
    assert latest_step(root)["step"] == 2  # type: ignore[index]
    before = pointer.read_bytes()
    real = checkpoint._atomic_write

    def full_at_the_pointer(path: Path, write: Callable[[Any], object]) -> None:
        if path.name == "latest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, write)

    monkeypatch.setattr(checkpoint, "_atomic_write", full_at_the_pointer)
    with pytest.raises(RuntimeConfigError) as info:
        pipe.fit(batches(), max_steps=4)
    assert str(info.value) == (
        f"cannot write checkpoint pointer {pointer}: No space left on device; the stage files "
        f"of step 4 were written but not published (they are removed), so the latest "
        f"checkpoint stays the previous one (step 2). Free space, or point --checkpoint-dir "
        f"elsewhere and resume from it"
    )
    assert pointer.read_bytes() == before
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000002"]
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(checkpoint, "_atomic_write", real)
    again = Pipeline(layers(), method="pipeoptim", stages=2, checkpoint_dir=str(root))
    result = again.fit(batches(), max_steps=4, resume=True)
    assert result.start_step == 2 and result.end_step == 4


def test_the_cli_says_it_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = checkpoint._atomic_write

    def full_at_the_pointer(path: Path, write: Callable[[Any], object]) -> None:
        if path.name == "latest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, write)

    monkeypatch.setattr(checkpoint, "_atomic_write", full_at_the_pointer)
    root = tmp_path / "ckpt"
    argv = ["train", "--max-steps", "2", "--stages", "2", "--device", "cpu", "--quiet"]
    assert main([*argv, "--checkpoint-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"cannot write checkpoint pointer {root / 'latest.json'}: No space left on device" in err
    assert "stays the previous one (none)" in err
    assert not (root / "latest.json").exists() and not list(root.glob("step-*"))


# ------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 2.5}, "micro_batches must be a whole number >= 1 (got 2.5)"),
        (
            {"method": "gpipe", "micro_batches": 2.5},
            "micro_batches must be a whole number >= 1 (got 2.5)",
        ),
        (
            {"prediction_offset": "a"},
            "prediction_offset must be a whole number in 0..2 (the stage count) (got 'a')",
        ),
        (
            {"prediction_offset": -5},
            "prediction_offset must be a whole number in 0..2 (the stage count) (got -5)",
        ),
        ({"prediction_offset": 3}, "prediction_offset must be a whole number in 0..2"),
        (
            {"method": "gpipe", "prediction_offset": 1},
            "prediction_offset 1 shifts the distance a predicting method",
        ),
        (
            {"grad_clip": "x"},
            "grad_clip must be a positive number, the largest gradient norm of a stage (got 'x')",
        ),
        ({"timeout": "x"}, "timeout must be a number of seconds in (0, 1e+09] (got 'x')"),
        ({"timeout": math.inf}, "timeout must be a number of seconds in (0, 1e+09] (got inf)"),
        ({"virtual_stages": 0}, "virtual_stages must be a whole number >= 1 (got 0)"),
        (
            {"method": "interleaved-1f1b", "stages": 1, "virtual_stages": 0},
            "virtual_stages must be a whole number >= 1 (got 0)",
        ),
        ({"virtual_stages": 3}, "pipeoptim runs one stage per rank (got 3 virtual stages)"),
        ({"memory_every": 0}, "memory_every must be a whole number >= 1 (got 0)"),
        ({"memory_every": -1}, "memory_every must be a whole number >= 1 (got -1)"),
        (
            {"keep_checkpoints": "x", "checkpoint_dir": "ckpt"},
            "keep_checkpoints must be a whole number >= 1 (got 'x')",
        ),
        (
            {"checkpoint_dir": 1},
            "checkpoint_dir must be a folder path (str or os.PathLike; got int)",
        ),
        ({"method": 1}, "method must be a method's name, e.g. method='pipeoptim' (got int)"),
        ({"device": 1}, "device must be a name: 'auto', 'cpu', 'cuda' or 'cuda:N' (got int)"),
        ({"scheduler": 1}, "scheduler must be a factory optimizer -> LR scheduler (got int)"),
        ({"predicted_backward": "x"}, "predicted_backward must be True or False (got 'x')"),
        ({"seed": True}, "seed must be an integer in 0..4294967295 (got True)"),
    ],
)
def test_constructor_arguments_are_checked(kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("stages", 2)
    with pytest.raises(PipeoptimError) as info:
        Pipeline(layers(), **kwargs)
    assert message in str(info.value)


def test_lbfgs_is_refused_at_construction() -> None:
    with pytest.raises(StageError) as info:
        Pipeline(layers(), stages=2, optimizer=lambda params: torch.optim.LBFGS(params))
    assert str(info.value).startswith(
        "stage 0: LBFGS.step needs a closure that re-evaluates the loss (several forwards and "
        "backwards of the whole model per update), which a pipeline stage cannot give"
    )
    assert "use a first-order optimizer (SGD, Adam, AdamW, RMSprop...)" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps_per_epoch": "2"}, "steps_per_epoch must be a whole number >= 1 (got '2')"),
        ({"epochs": True}, "epochs must be a whole number >= 1 (got True)"),
        (
            {"eval_every": 2},
            "eval_every=2 evaluates on eval_data every 2 mini-batches, and no eval_data was given",
        ),
        (
            {"resume": True},
            "fit(..., resume=True) continues from the latest checkpoint in checkpoint_dir, "
            "and this Pipeline has none",
        ),
        ({"resume": "yes"}, "resume must be True or False (got 'yes')"),
        ({"eval_data": 1}, "fit's eval_data must be an iterable of (input, target) batches"),
    ],
)
def test_fit_arguments_are_checked(kwargs: dict[str, Any], message: str) -> None:
    pipe = Pipeline(layers(), stages=2)
    with pytest.raises(RuntimeConfigError) as info:
        pipe.fit(batches(), max_steps=2, **kwargs)
    assert message in str(info.value)
    assert pipe.fit(batches(), max_steps=2).end_step == 2  # still usable


def test_a_resume_whose_run_ends_before_the_checkpoint_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    Pipeline(layers(), stages=2, checkpoint_dir=root).fit(batches(), max_steps=4)
    again = Pipeline(layers(), stages=2, checkpoint_dir=root)
    before = weights(again)
    with pytest.raises(RuntimeConfigError) as info:
        again.fit(batches(), max_steps=2, resume=True)
    assert str(info.value) == (
        f"the checkpoint in {root} is at step 4, past the end of this run (max_steps=2 ends at "
        f"step 2); epochs and max_steps count from step 0, not from where the run resumes, so "
        f"nothing would train; ask for a run that ends after step 4 (e.g. max_steps=5 or more)"
    )
    assert again.step == 0 and all(
        torch.equal(a, b) for a, b in zip(before, weights(again), strict=True)
    )
    assert again.fit(batches(), max_steps=4, resume=True).end_step == 4  # at the end: nothing to do
    # a second fit of one Pipeline, shorter than the first
    pipe = Pipeline(layers(), stages=2)
    pipe.fit(batches(), epochs=1)
    with pytest.raises(
        RuntimeConfigError,
        match=r"this Pipeline has trained to step 4, past the end of this run "
        r"\(max_steps=3 ends at step 3\)",
    ):
        pipe.fit(batches(), max_steps=3)


_CLOSED = """
import os, socket, torch
from torch import nn
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
from pipeoptim import Pipeline
from pipeoptim.errors import PipeoptimError
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 3))
pipe = Pipeline(net, stages=1, transport="dist", device="cpu", timeout=30)
data = [(torch.randn(4, 4), torch.randint(0, 3, (4,))) for _ in range(2)]
pipe.fit(data, max_steps=1)
pipe.close()
for call in (lambda: pipe.fit(data, max_steps=2), lambda: pipe.evaluate(data)):
    try:
        call()
        print("no error")
    except PipeoptimError as err:
        print("refused:", err)
"""


def test_fit_after_close_under_dist_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "closed.py"
    script.write_text(_CLOSED)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    expected = (
        "refused: this Pipeline's process group is closed (pipe.close() left it), and a dist "
        "Pipeline trains and evaluates through it; call fit and evaluate before close(), or "
        "build a new Pipeline (it joins or starts a process group) and resume from its checkpoint"
    )
    assert lines == [expected, expected], proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------ CLI
def test_compare_out_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "afile"
    out.write_text("x")
    argv = ["compare", "--methods", "gpipe", "--optimizers", "sgd", "--stages", "1"]
    assert main([*argv, "--seeds", "1", "--epochs", "1", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--out {str(out)!r} is a file, not a folder; compare writes a folder" in err
    assert out.read_text() == "x"


def test_train_plan_with_replicas_starts_dist(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    Plan("1f1b", 2, micro_batches=2, data_parallel=2, batch_size=32).save(plan)
    parser = build_parser()
    assert build_config(parser.parse_args(["train", "--plan", str(plan)])).transport == "dist"
    assert build_config(parser.parse_args(["train", "--data-parallel", "2"])).transport == "dist"
    assert build_config(parser.parse_args(["train"])).transport == "local"
    with pytest.raises(RuntimeConfigError, match="needs --transport dist"):
        build_config(parser.parse_args(["train", "--plan", str(plan), "--transport", "local"]))


def test_train_prediction_offset_for_a_method_that_does_not_predict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--method", "gpipe", "--prediction-offset", "1", "--max-steps", "1"]) == 2
    assert (
        "--prediction-offset 1 shifts the distance a predicting method predicts ahead, and "
        "gpipe does not predict" in capsys.readouterr().err
    )
    assert main(["train", "--stages", "2", "--prediction-offset", "3", "--max-steps", "1"]) == 2
    assert "--prediction-offset must be a whole number in 0..2" in capsys.readouterr().err


def test_plan_devices_says_why_micro_batching_methods_are_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    Profile.uniform(6, 0.01, 0.02, activation_bytes=1000, param_bytes=4000, batch_size=32).save(
        profile
    )
    argv = ["plan", "--profile", str(profile), "--devices", "4", "--micro-batches", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # pipeoptim's dial takes the given M too, and so is dropped with the others
    dropped = (
        "gpipe, 1f1b, 2bw, xpipe, pipeoptim, zb-h1, pipeoptim+shrink, pipeoptim+pipemare, "
        "pipeoptim+nesterov, pipeoptim+qk-clip, xpipe+extrapolate, 2bw+extrapolate and "
        "pipeoptim+extrapolate dropped"
    )
    assert (
        f"note: P=4 x D=1: {dropped}: a replica's 32 samples do not "
        "split into 3 micro-batches (the runtime splits each replica's batch evenly into the "
        "micro-batches); pass a --micro-batches that divides 32, or a --global-batch divisible "
        "by 1 x 3 = 3"
    ) in out
    assert f"note: P=1 x D=4: {dropped}: a replica's 8 samples" in out
    # a batch that splits: the method's own rule (M >= P) is the note
    assert main([*argv, "--global-batch", "24", "--json"]) == 0
    dropped = json.loads(capsys.readouterr().out)["dropped"]
    assert (
        "P=4 x D=1: 1f1b (M=3) dropped: 1f1b needs at least as many micro-batches as stages "
        "(got 3 micro-batches for 4 stages); raise --micro-batches to 4 or more"
    ) in dropped
    assert len(dropped) == 4  # 1f1b, 2bw, zb-h1 and 2bw+extrapolate at P=4


def test_plan_stages_says_that_auto_does_not_search_the_given_micro_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    Profile.uniform(6, 0.01, 0.02, activation_bytes=1000, param_bytes=4000, batch_size=32).save(
        profile
    )
    assert main(["plan", "--profile", str(profile), "--stages", "4", "--micro-batches", "3"]) == 0
    assert "note: --micro-batches 3 is not searched with --method auto" in capsys.readouterr().err


# --------------------------------------------------------------------------- the fuzz
SECONDS_PER_EXAMPLE = 20.0
MAX_RSS_BYTES = 3 << 30
"""The memory cap of tests/cli/test_fuzz.py: peak resident memory of the test process."""

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_WRONG = [None, True, -1, 0, 2.5, "x", math.nan, math.inf, [1]]
_BAD = st.sampled_from([*_WRONG, 10**12])
_BAD_LENGTH = st.sampled_from(_WRONG)
"""For the run's length: 10**12 epochs or steps would be accepted, and a long run."""


def _mix(
    good: list[Any], bad: tuple[Any, ...] = (), wrong: st.SearchStrategy[Any] = _BAD
) -> st.SearchStrategy[Any]:
    """Mostly good values (7 in 8), else a wrong type, an absurd value or one of ``bad``."""
    other = st.one_of(wrong, st.sampled_from(bad)) if bad else wrong
    return st.integers(0, 7).flatmap(lambda i: other if i == 0 else st.sampled_from(good))


def _sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adam(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _lbfgs(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(params)


def _not_an_optimizer(params: list[Tensor]) -> object:
    return params


def _cosine(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)


def _plateau(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt)


def _init_weights(index: int, unit: nn.Module) -> None:
    for p in unit.parameters():
        nn.init.normal_(p, std=0.1)


def _per_sample(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target, reduction="none")


METHODS = [
    "pipeoptim",
    "gpipe",
    "1f1b",
    "pipedream",
    "2bw",
    "xpipe",
    "spectrain",
    "zb-h1",
    "2bw+extrapolate",
]

CONSTRUCTOR = {
    "method": _mix([None, *METHODS], ("interleaved-1f1b", "zb-v", "bogus")),
    "stages": _mix([1, 2, 2, 3], (10**9,)),
    "micro_batches": _mix([None, 1, 2, 4], (3, 8, 10**12)),
    "virtual_stages": _mix([None, 1], (2, 3)),
    "prediction_offset": _mix([None, 0, 1], (2, 5)),
    "optimizer": _mix(
        [None, _sgd, _adam, OptimizerSpec("adam", 1e-3)], (_lbfgs, _not_an_optimizer)
    ),
    "scheduler": _mix([None, _cosine], (_plateau,)),
    "loss_fn": _mix([F.cross_entropy, None], (_detached, _constant, _per_sample)),
    "amp": _mix([None, None, "bf16"], ("fp16", "fp8")),
    "grad_clip": _mix([None, 1.0, 0.5]),
    "clip_scope": _mix([None, "pipeline", "stage"], ("model",)),
    "extrapolation": _mix([None, None, 0.5], (-1.0, math.nan, math.inf)),
    "timeout": _mix([300.0, 30]),
    "log_every": _mix([50, 1]),
    "memory_every": _mix([4, 1]),
    "seed": _mix([0, 7], (2**40,)),
    # no string among the wrong values: it would be a folder here
    "checkpoint_dir": _mix([None, "FRESH"], wrong=st.sampled_from([None, 1, 2.5, [1], True])),
    "checkpoint_every": _mix([None, 1, 2]),
    "keep_checkpoints": _mix([2, 1]),
    "checkpoint_format": _mix(["torch-save", "dcp"], ("pickle", 3)),
    "transport": _mix(["local"], ("pigeon",)),
    "device": _mix(["cpu"], ("quantum",)),
    "targets": _mix(["send", "read"], ("both",)),
    "data_parallel": _mix([None, 1], (2,)),
    "predicted_backward": _mix([False, True]),
    "init_weights": _mix([None, _init_weights], (3, "normal")),
    "plan": _mix([None, Plan("1f1b", 2, micro_batches=2), Plan("pipeoptim", 3)]),
    "recompute": _mix(
        [None, "none", "full", ["0"], "units:Linear", {0: "full"}],
        ("most", ["Conv2d"], {9: "full"}, 3, [True]),
    ),
    "shard_optimizer": _mix([None, False], (True, "yes")),
    "loggers": _mix([None, []], ("tensorboard:runs", [3], 5)),
    "callbacks": _mix([None, [], [Callback()]], ("on_step_end", [object()], 7)),
    "tune_allocator": _mix([True, False], ("yes", 1, None)),
    "forwards_first": _mix([False, True], ("yes", 1, None)),
    "varying_shapes": _mix([False, True], ("yes", 1, None)),
    "one_tag": _mix([False, True], ("yes", 1, None)),
    "compile": _mix([False, False, "eager"], ("turbo", 3)),
    "options": _mix(
        [None, PipelineConfig(), PipelineConfig(seed=3, observe=ObserveOptions(log_every=1))],
        ({"stages": 2}, 5),
    ),
}
"""Every argument but ``store``, ``progress`` and the run identity (internal to the CLI).
``transport="dist"`` is left out: it joins a process group (tests/runtime/test_dist.py)."""

FIT = {
    "epochs": _mix([None, 1], wrong=_BAD_LENGTH),
    "max_steps": _mix([None, 1, 2, 3], wrong=_BAD_LENGTH),
    "eval_data": _mix([None, "EVAL"]),
    "eval_every": _mix([None, 1, 2]),
    "steps_per_epoch": _mix([None, 1, 3], wrong=_BAD_LENGTH),
    "resume": _mix([False, True]),
}
"""Bounded so that an accepted run is at most 4 mini-batches (the data's length)."""


@st.composite
def arguments(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """About a quarter of the arguments each time (the rest default); always ``stages``,
    else most examples would stop at its absence."""
    made = {
        k: draw(v) for k, v in CONSTRUCTOR.items() if k == "stages" or draw(st.integers(0, 3)) == 0
    }
    fit = {k: draw(v) for k, v in FIT.items() if draw(st.integers(0, 2)) == 0}
    return made, fit


@FUZZ
@given(args=arguments())
def test_fuzz_pipeline_constructor_and_fit_arguments(
    args: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    made, fit = args
    made, fit = dict(made), dict(fit)
    shown = f"Pipeline(**{made}).fit(**{fit})"
    folder = tempfile.TemporaryDirectory(prefix="pipeoptim-fuzz-")
    if made.get("checkpoint_dir") == "FRESH":
        made["checkpoint_dir"] = folder.name
    if fit.get("eval_data") == "EVAL":
        fit["eval_data"] = batches(2)
    start = time.perf_counter()
    with folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pipe = Pipeline(layers(), progress=False, **made)
            result = pipe.fit(batches(), **fit)
            assert result.end_step <= 4, shown
        except PipeoptimError:
            pass
        except Exception as err:  # the property: nothing but pipeoptim's one error type
            raise AssertionError(f"{shown} raised {type(err).__name__}: {err}") from err
    assert time.perf_counter() - start < SECONDS_PER_EXAMPLE, shown
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    assert peak < MAX_RSS_BYTES, shown


def test_the_fuzz_draws_every_user_argument() -> None:
    """A new constructor argument joins CONSTRUCTOR (or the list of those left out)."""
    names = set(inspect.signature(Pipeline.__init__).parameters) - {"self", "layers"}
    assert names - set(CONSTRUCTOR) == {"store", "progress", "run_identity", "hyperparameters"}
