"""Zero-bubble schedules (zb-h1, zb-v) in the runtime: each backward runs as its input half
I and its weight half W, and training equals single-process training on the full batch.

The gloo run spawns ranks that import this file for the model (``path.py:factory``).
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.versions import passes
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.optim.update import make_optimizer
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.trace import Trace
from pipeoptim.workloads.data import BatchOrder, Dataset
from pipeoptim.workloads.loader import build_model
from pipeoptim.workloads.train import build_run, train

HERE = Path(__file__)
STEPS = 6


def net() -> list[nn.Module]:
    """8 units, so up to 8 stages; an in-place ReLU rewrites the Linear output before it."""
    return [
        nn.Linear(6, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.ReLU(inplace=True),
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


def config(method: str, ranks: int, micro: int, family: str = "sgd", **kw: object) -> TrainConfig:
    lr = 0.05 if family == "sgd" else 0.01
    plan = Plan(
        method,
        ranks,
        micro_batches=micro,
        virtual_stages=2 if method == "zb-v" else 1,
        optimizer=OptimizerSpec(family, lr),
        model=f"{HERE}:net",
        batch_size=16,
    )
    kw.setdefault("device", "cpu")
    kw.setdefault("max_steps", STEPS)
    return TrainConfig(plan, **kw)  # type: ignore[arg-type]


def local_run(cfg: TrainConfig, memory_every: int = 4) -> Pipeline:
    pipe, data, _ = build_run(cfg)
    pipe.memory_every = memory_every
    pipe.fit(data, max_steps=cfg.max_steps)
    return pipe


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


def pipelined(pipe: Pipeline) -> list[Tensor]:
    return [p.detach() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]


@pytest.mark.parametrize(
    ("method", "ranks", "micro"),
    [("zb-h1", 2, 2), ("zb-h1", 2, 4), ("zb-h1", 4, 4), ("zb-h1", 4, 8), ("zb-v", 2, 4)],
)
@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_zero_bubble_equals_single_process_training(
    method: str, ranks: int, micro: int, family: str
) -> None:
    cfg = config(method, ranks, micro, family)
    pipe = local_run(cfg)
    assert len(pipe.stages) == ranks * (2 if method == "zb-v" else 1)
    got, want = pipelined(pipe), reference(cfg)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_zb_v_places_stages_in_a_v() -> None:
    pipe = local_run(config("zb-v", 2, 4))
    assert pipe.rank_of == {0: 0, 1: 1, 2: 1, 3: 0}


@pytest.mark.parametrize("method", ["zb-h1", "zb-v"])
def test_trace_holds_i_and_w_and_activations_are_released_at_w(method: str) -> None:
    ranks, micro = 2, 4
    pipe = local_run(config(method, ranks, micro), memory_every=1)
    stages = ranks * (2 if method == "zb-v" else 1)
    trace = pipe.trace()
    kinds = {e.kind for e in trace.events}
    assert {"F", "I", "W", "U"} <= kinds and "B" not in kinds
    i_of = {(e.stage, e.mb): e for e in trace.events if e.kind == "I"}
    w_of = {(e.stage, e.mb): e for e in trace.events if e.kind == "W"}
    assert len(i_of) == len(w_of) == stages * micro * STEPS
    assert set(i_of) == set(w_of)
    for key, w in w_of.items():
        assert w.start >= i_of[key].end, key
    # Memory is sampled after every compute action: a W releases its micro-batch's
    # activations, an I keeps them.
    samples: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for m in trace.memory:
        samples[m.rank].append((m.time, m.detail["activations"]))
    compute = sorted(
        (e for e in trace.events if e.kind in ("F", "I", "W", "U")), key=lambda e: e.end
    )
    seen_w = 0
    for rank, series in samples.items():
        before: dict[float, int] = {}
        last = 0
        for t, act in sorted(series):
            before[t] = last
            last = act
        for e in compute:
            if e.rank != rank or e.end not in before:
                continue
            after = dict(series)[e.end]
            if e.kind == "W":
                assert after < before[e.end], e
                seen_w += 1
            elif e.kind == "I":
                assert after >= before[e.end], e
    assert seen_w == stages * micro * STEPS
    assert all(stage.memory()["activations"] == 0 for stage in pipe.stages.values())


def test_amp_bf16_runs() -> None:
    result = train(config("zb-h1", 2, 2, amp="bf16", epochs=2, max_steps=None))
    assert result is not None
    assert all(torch.isfinite(torch.tensor(loss)) for loss in result.losses)
    assert result.losses[-1] < result.losses[0]


@pytest.mark.slow
def test_zb_h1_over_gloo_equals_single_process_training(tmp_path: Path) -> None:
    cfg = config(
        "zb-h1",
        2,
        2,
        "adam",
        transport="dist",
        timeout=60,
        checkpoint_dir=str(tmp_path),
        trace=str(tmp_path / "trace.json"),
    )
    result = train(cfg)
    assert result is not None
    want = reference(cfg)
    got = []
    for k in range(2):
        saved = torch.load(tmp_path / f"step-{STEPS:08d}" / f"stage-{k}.pt", weights_only=True)
        got += list(saved["state"]["module"].values())
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    trace = Trace.load(tmp_path / "trace.json")
    assert len(trace.events_of(kinds=["I"])) == len(trace.events_of(kinds=["W"])) == 2 * 2 * STEPS


# -- the stage on its own ------------------------------------------------------------------


def stack(width: int = 16, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def make_stage(layers: nn.Sequential, method: str = "zb-h1", index: int = 1) -> Stage:
    return Stage(
        index,
        layers,
        num_stages=3,
        method=get_method(method),
        options=StageOptions(OptimizerSpec("sgd", 0.1)),
        micro_batches=2,
    )


@pytest.mark.parametrize(
    "layers",
    [
        stack(),
        nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16)),
        nn.Sequential(*(2 * [nn.Linear(16, 16)])),  # one weight in two units: one W pass
    ],
    ids=["linear-stack", "inplace", "shared-weight"],
)
def test_i_then_w_equals_the_full_backward(layers: nn.Sequential) -> None:
    full = make_stage(copy.deepcopy(layers), method="1f1b")
    stage = make_stage(layers)
    text = "0F0 0F1 0I0 0I1 0W1 0W0 0U0"
    stage.begin_segment(passes("zb-h1", text, 2))
    full.begin_segment(passes("1f1b", "0F0 0F1 0B0 0B1 0U0", 2))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g) for _ in range(2)]
    grads = [torch.randn(8, 16, generator=g) for _ in range(2)]
    for mb in range(2):
        assert torch.equal(stage.forward(mb, xs[mb]), full.forward(mb, xs[mb]))
    act = stage.memory()["activations"]
    assert act > 0
    g_in = [stage.backward_input(mb, grads[mb]) for mb in range(2)]
    assert all(p.grad is None for p in stage.module.parameters())  # no weight gradient yet
    assert stage.memory()["activations"] >= act  # held until W
    want = [full.backward(mb, grads[mb]) for mb in range(2)]
    for a, b in zip(g_in, want, strict=True):
        assert a is not None and b is not None and torch.allclose(a, b, atol=1e-6)
    stage.backward_weight(1)
    assert 0 < stage.memory()["activations"] < act
    stage.backward_weight(0)
    assert stage.memory()["activations"] == 0
    assert stage.memory()["gradients"] == stage.memory()["weights"]
    for p, q in zip(stage.module.parameters(), full.module.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    stage.update()


def test_last_stage_i_and_w_on_the_loss() -> None:
    stage = make_stage(stack(), index=2)
    stage.begin_segment(passes("zb-h1", "0F0 0I0 0W0 0U0", 1))
    x, y = torch.randn(8, 16), torch.randint(0, 16, (8,))
    stage.forward(0, x, y)
    x_leaf = x.clone().requires_grad_(True)
    ref = stack()
    loss = F.cross_entropy(ref(x_leaf), y) / 2
    loss.backward()
    g_in = stage.backward_input(0)
    assert g_in is not None and torch.allclose(g_in, x_leaf.grad, atol=1e-6)  # type: ignore[arg-type]
    stage.backward_weight(0)
    for p, q in zip(stage.module.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)  # type: ignore[arg-type]


def test_w_before_i_and_split_for_asynchronous_policies_are_refused() -> None:
    stage = make_stage(stack())
    stage.begin_segment(passes("zb-h1", "0F0 0I0 0W0 0U0", 1))
    stage.forward(0, torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="W of micro-batch 0 before its I"):
        stage.backward_weight(0)
    async_stage = make_stage(stack(), method="pipedream")
    async_stage.begin_segment(passes("pipedream", "0F0 0B0 0U0", 1))
    async_stage.forward(0, torch.randn(8, 16))
    with pytest.raises(RuntimeConfigError, match="only for synchronous"):
        async_stage.backward_input(0, torch.randn(8, 16))


def test_w_costs_the_weight_part_only() -> None:
    """W computes weight gradients only: for a Linear stack it is about one matmul per
    layer, as I is (a full backward is two); measured here against a full backward."""
    torch.manual_seed(0)
    width, depth, batch = 512, 4, 256
    stage = make_stage(stack(width, depth))
    full = make_stage(stack(width, depth), method="1f1b")
    x, g = torch.randn(batch, width), torch.randn(batch, width)
    reps = 4
    text = " ".join(f"0F{i} 0I{i} 0W{i}" for i in range(reps)) + " 0U0"
    stage.begin_segment(passes("zb-h1", text, reps))
    full.begin_segment(passes("1f1b", " ".join(f"0F{i} 0B{i}" for i in range(reps)) + " 0U0", reps))
    t_i = t_w = t_b = 0.0
    for mb in range(reps):
        stage.forward(mb, x)
        start = time.perf_counter()
        stage.backward_input(mb, g)
        t_i += time.perf_counter() - start
        start = time.perf_counter()
        stage.backward_weight(mb)
        t_w += time.perf_counter() - start
        full.forward(mb, x)
        start = time.perf_counter()
        full.backward(mb, g)
        t_b += time.perf_counter() - start
    assert t_w < 0.85 * t_b, (t_i, t_w, t_b)  # measured: W ~ I ~ B/2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("amp", [None, "fp16"])
def test_zero_bubble_on_one_gpu(amp: str | None) -> None:
    """zb-h1 and zb-v with every stage on cuda:0: the CPU run's losses (fp32), and under
    fp16 (GradScaler) a run that learns."""
    for method, micro in (("zb-h1", 2), ("zb-v", 4)):
        gpu = train(config(method, 2, micro, device="cuda", amp=amp))
        assert gpu is not None and gpu.device.startswith("cuda")
        if amp is None:
            cpu = train(config(method, 2, micro))
            assert cpu is not None
            assert gpu.losses == pytest.approx(cpu.losses, abs=1e-4)
        else:
            assert all(torch.isfinite(torch.tensor(loss)) for loss in gpu.losses)
