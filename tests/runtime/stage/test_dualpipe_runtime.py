"""DualPipeV and interleaved zero bubble in the runtime: the overlapped steps run as their
two actions back to back (as PyTorch's runtime runs OVERLAP_F_B), B and I/W mix on one
stage, and training equals single-process training on the full batch, locally and over
gloo (local and dist bitwise equal: the same computation).

The gloo run spawns ranks that import this file for the model (``path.py:factory``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim.plan.actions import Action, U, compact, load_csv
from pipeoptim.plan.methods import get_method, registered
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.shape import Shape
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.optim.update import make_optimizer
from pipeoptim.trace import Trace
from pipeoptim.workloads.data import BatchOrder, Dataset
from pipeoptim.workloads.loader import build_model
from pipeoptim.workloads.train import build_run, train

HERE = Path(__file__)
STEPS = 4


def net() -> list[nn.Module]:
    """8 units: up to 8 stages."""
    return [
        nn.Linear(6, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Sequential(nn.Linear(12, 8), nn.Tanh()),
        nn.Linear(8, 3),
    ]


def dataset() -> Dataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.7).long()
    return Dataset("toy", x[:80], y[:80], x[80:], y[80:], 3)


def config(method: str, ranks: int, micro: int, **kw: object) -> TrainConfig:
    plan = Plan(
        method,
        ranks,
        micro_batches=micro,
        virtual_stages=1 if method == "gpipe" else 2,
        optimizer=OptimizerSpec("adam", 0.01),
        model=f"{HERE}:net",
        batch_size=24,
    )
    kw.setdefault("device", "cpu")
    kw.setdefault("max_steps", STEPS)
    return TrainConfig(plan, **kw)  # type: ignore[arg-type]


def reference(cfg: TrainConfig) -> list[Tensor]:
    """Single-process training on each full mini-batch: the weights after the run."""
    layers, data = build_model(cfg.model, cfg.seed)
    model = nn.Sequential(*layers)
    opt = make_optimizer(cfg.plan.optimizer, model.parameters())
    order = BatchOrder(len(data.train_x), cfg.batch_size, cfg.seed)
    for t in range(STEPS):
        idx = order.indices(t)
        F.cross_entropy(model(data.train_x[idx]), data.train_y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(
    ("method", "ranks", "micro"),
    [("dualpipev", 2, 4), ("dualpipev", 3, 6), ("dualpipev", 4, 8), ("interleaved-zb", 2, 4)],
)
def test_equals_single_process_training(method: str, ranks: int, micro: int) -> None:
    cfg = config(method, ranks, micro)
    pipe, data, _ = build_run(cfg)
    pipe.fit(data, max_steps=cfg.max_steps)
    assert len(pipe.stages) == 2 * ranks
    got = [p.detach() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]
    want = reference(cfg)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("method", ["dualpipev", "interleaved-zb"])
def test_updates_are_gpipes(method: str) -> None:
    """Synchronous: gpipe's updates (the study's rows of these methods are gpipe's, as
    zb-v's are), to a float32 tolerance (the sums run in another order)."""
    runs = []
    for name, ranks in ((method, 2), ("gpipe", 4)):
        cfg = config(name, ranks, 4)
        pipe, data, _ = build_run(cfg)
        pipe.fit(data, max_steps=cfg.max_steps)
        runs.append(
            [p.detach() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]
        )
    tol = 16 * torch.finfo(torch.float32).eps
    for a, b in zip(*runs, strict=True):
        assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dualpipev", "interleaved-zb"])
def test_over_gloo_equals_the_local_run_bitwise(method: str, tmp_path: Path) -> None:
    """Two gloo ranks, two stages each: the weights equal the local run's bit for bit, and
    the trace holds the split halves and the full backwards of the overlapped steps."""
    local = config(method, 2, 4, checkpoint_dir=str(tmp_path / "local"))
    assert train(local) is not None
    dist = config(
        method,
        2,
        4,
        transport="dist",
        timeout=90,
        checkpoint_dir=str(tmp_path / "dist"),
        trace=str(tmp_path / "trace.json"),
    )
    assert train(dist) is not None
    for k in range(4):
        name = Path(f"step-{STEPS:08d}") / f"stage-{k}.pt"
        a = torch.load(tmp_path / "local" / name, weights_only=True)["state"]["module"]
        b = torch.load(tmp_path / "dist" / name, weights_only=True)["state"]["module"]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[key], b[key]) for key in a)
    trace = Trace.load(tmp_path / "trace.json")
    inputs, weights = trace.events_of(kinds=["I"]), trace.events_of(kinds=["W"])
    assert len(inputs) == len(weights) > 0
    full = trace.events_of(kinds=["B"])
    assert len(inputs) + len(full) == 4 * 4 * STEPS
    assert (len(full) > 0) == (method == "dualpipev")


def test_torch_dualpipe_v_dump_runs_as_our_dualpipev(tmp_path: Path) -> None:
    """PyTorch's ScheduleDualPipeV dump (P = 4, M = 8) trained as a method of its own: the
    same weights, bit for bit, as our dualpipev (the same order: the same computation)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from support.torch_schedules import mock_stages

    ranks, micro = 4, 8
    path = tmp_path / "dualpipev.csv"
    stages = mock_stages("ScheduleDualPipeV", 0, ranks)
    schedules.ScheduleDualPipeV(stages, micro)._dump_csv(str(path), format="compute_only")
    one = compact(load_csv(path))

    def from_dump(shape: Shape) -> dict[int, list[Action]]:
        return {
            r: [
                a
                for t in range(shape.mini_batches)
                for a in [
                    *(Action(x.stage, x.kind, t * micro + x.mb, x.overlapped) for x in acts),
                    Action(r, U, t),
                    Action(2 * ranks - 1 - r, U, t),
                ]
            ]
            for r, acts in one.items()
        }

    dump = replace(get_method("dualpipev"), name="torch-dualpipev-dump", generator=from_dump)
    weights = []
    for method in (dump, get_method("dualpipev")):
        with registered(method) if method is dump else nullcontext():
            cfg = config(method.name, ranks, micro, max_steps=2)
            pipe, data, _ = build_run(cfg)
            pipe.fit(data, max_steps=2)
            weights.append(
                [
                    p.detach().clone()
                    for k in sorted(pipe.stages)
                    for p in pipe.stages[k].module.parameters()
                ]
            )
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
