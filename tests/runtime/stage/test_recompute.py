"""Activation recomputation: a recomputed run is the same computation as the run without it,
bit for bit, for every method (docs/design.md, "Activation recomputation and weight versions"),
and holds less.

What would break each rule: a recomputation on the live weights instead of Ŵ or the stashed
version, a held Ŵ not overwritten with the live weights before the backward, a saved cast of
Ŵ not re-cast, the RNG stream drawn again, a batch norm's statistics updated twice, a QK-Clip
recorder recording the recomputation; each changes the weights below.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim.errors import PlanError, RuntimeConfigError
from pipeoptim.plan.methods import METHODS
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.recompute import UnitLabels, parse_recompute_flag, resolve_recompute
from pipeoptim.runtime.optim.corrections.qk_clip import QKClip
from pipeoptim.runtime.optim.corrections.registry import CORRECTIONS
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.workloads.gpt import Block, lm_loss

HERE = Path(__file__)
ROOT = HERE.resolve().parents[3]


class Pair(nn.Module):
    """Hands on a tuple (the next unit's two arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), torch.tanh(x)


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(16, 16)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return torch.relu(self.b(x)) + y


def units() -> list[nn.Module]:
    """Nine units: weights, dropout (the RNG stream), a tuple between units, a layer norm."""
    torch.manual_seed(0)
    return [
        nn.Linear(8, 16),
        nn.GELU(),
        nn.Dropout(0.1),
        Pair(),
        Join(),
        nn.Linear(16, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 16),
        nn.Linear(16, 4),
    ]


def batches(n: int = 4) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)
    ]


def method_shape(name: str) -> dict[str, Any]:
    """Stages and micro-batches each method runs here (2bw needs M >= P, zb-v and the
    interleaved schedule two stages per rank; pipeoptim its default, whole mini-batches)."""
    method = METHODS[name]
    kw: dict[str, Any] = {"stages": 3}
    if method.micro_batched_by_default:
        kw["micro_batches"] = 4
    # looped interleaving (interleaved-1f1b, interleaved-zb): M a multiple of the ranks
    if method.places_several_stages_per_rank and not method.folds_stages_in_a_v:
        kw.update(stages=2, virtual_stages=2)
    return kw


class Counted:
    """Counts the training forwards of every unit (a recomputation is one more)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.calls = 0
        for m in modules:
            m.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.calls += 1


def train(
    name: str,
    recompute: object,
    *,
    build: Callable[[], list[nn.Module]] = units,
    data: list[Any] | None = None,
    **kw: Any,
) -> tuple[Pipeline, list[float], list[Tensor], int]:
    layers = build()
    counter = Counted(layers)
    pipe = Pipeline(
        layers,
        method=name,
        optimizer=OptimizerSpec("adam", 0.01),
        recompute=recompute,
        memory_every=1,
        **{**method_shape(name), **kw},
    )
    result = pipe.fit(data if data is not None else batches(), epochs=1)
    weights = [p.detach().clone() for s in pipe.stages.values() for p in s.module.parameters()]
    return pipe, result.losses, weights, counter.calls


def assert_same(a: Sequence[Tensor], b: Sequence[Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


BASE_METHODS = [n for n, m in METHODS.items() if m.delay_correction != "qk-clip"]


@pytest.mark.parametrize("name", BASE_METHODS)
def test_every_method_recomputed_equals_the_run_without_it_bit_for_bit(name: str) -> None:
    _, losses, weights, calls = train(name, None)
    variants: list[object] = ["full", ["Pair", "4"]]
    if name in ("pipeoptim", "pipedream"):
        variants.append({0: "full"})
    for recompute in variants:
        _, r_losses, r_weights, r_calls = train(name, recompute)
        assert r_losses == losses, recompute
        assert_same(r_weights, weights)
        assert r_calls > calls, recompute  # the recomputations ran


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "pipedream", "2bw", "pipeoptim", "xpipe"])
def test_under_bf16_autocast_the_recast_weights_are_those_of_the_run_without_it(name: str) -> None:
    _, losses, weights, _ = train(name, None, amp="bf16")
    _, r_losses, r_weights, _ = train(name, "full", amp="bf16")
    assert r_losses == losses
    assert_same(r_weights, weights)


def test_a_predicted_backward_recomputes_on_its_own_prediction() -> None:
    _, losses, weights, _ = train("pipeoptim", None, predicted_backward=True)
    _, r_losses, r_weights, _ = train("pipeoptim", "full", predicted_backward=True)
    assert r_losses == losses
    assert_same(r_weights, weights)


def bn_units() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16),
        nn.Linear(16, 4),
    ]


def test_a_batch_norm_updates_its_statistics_once_per_forward() -> None:
    runs = []
    for recompute in (None, "full"):
        pipe, *_ = train("pipeoptim", recompute, build=bn_units, stages=2)
        runs.append(
            [t.clone() for s in pipe.stages.values() for t in s.module.state_dict().values()]
        )
    assert_same(runs[1], runs[0])


VOCAB = 23


def block_units() -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [Block(16, 4, 1) for _ in range(4)]
    for b in blocks:
        with torch.no_grad():
            b.qkv.weight[:32].mul_(8)  # logits large enough to clip
    return [nn.Embedding(VOCAB, 16), *blocks, nn.Linear(16, VOCAB)]


@pytest.mark.parametrize("name", ["pipeoptim+qk-clip", "pipedream+qk-clip"])
def test_qk_clip_records_each_forward_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CORRECTIONS, "qk-clip", lambda c, o: QKClip(c, o, threshold=0.5))
    ids = torch.randint(0, VOCAB, (6, 4, 9), generator=torch.Generator().manual_seed(3))
    data = [(s[:, :-1], s[:, 1:]) for s in ids]
    runs = []
    for recompute in (None, "units:Block"):
        pipe, losses, weights, _ = train(
            name, recompute, build=block_units, data=data, loss_fn=lm_loss
        )
        clips = [s.updater.correction.clips for s in pipe.stages.values()]  # type: ignore[union-attr]
        runs.append((losses, weights, clips))
    assert runs[1][0] == runs[0][0]
    assert_same(runs[1][1], runs[0][1])
    assert runs[1][2] == runs[0][2] and sum(runs[0][2]) > 0


def tied_units() -> list[nn.Module]:
    """A weight two units of stage 1 share (a tie inside a stage is plain autograd)."""
    torch.manual_seed(0)
    first, second = nn.Linear(16, 16), nn.Linear(16, 16)
    second.weight = first.weight
    return [
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        first,
        nn.Tanh(),
        second,
        nn.Linear(16, 4),
    ]


@pytest.mark.parametrize("name", ["pipeoptim", "pipedream", "gpipe"])
def test_a_weight_shared_by_two_recomputed_units_keeps_each_uses_prediction(name: str) -> None:
    _, losses, weights, _ = train(name, None, build=tied_units, stages=2)
    _, r_losses, r_weights, _ = train(name, "full", build=tied_units, stages=2)
    assert r_losses == losses
    assert_same(r_weights, weights)


def peaks(pipe: Pipeline, kind: str) -> dict[int, int]:
    """The most bytes of ``kind`` each rank's stages held at once, from the run's samples."""
    out: dict[int, int] = {}
    for m in pipe.recorder.memory:
        out[m.rank] = max(out.get(m.rank, 0), m.detail.get(kind, 0))
    return out


def wide_units() -> list[nn.Module]:
    torch.manual_seed(0)
    return [m for _ in range(6) for m in (nn.Linear(64, 64), nn.GELU())] + [nn.Linear(64, 4)]


def wide_batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g))
        for _ in range(6)
    ]


@pytest.mark.parametrize("name", ["1f1b", "pipedream", "pipeoptim"])
def test_recomputation_holds_the_stage_inputs_and_for_predictions_their_weights(name: str) -> None:
    full, *_ = train(name, None, build=wide_units, data=wide_batches(), stages=3)
    rec, *_ = train(name, "full", build=wide_units, data=wide_batches(), stages=3)
    before, after = peaks(full, "activations"), peaks(rec, "activations")
    for k in range(3):  # a stage of Linear/GELU pairs keeps its input and output only
        # (1f1b's first stage: its micro-batches are views of the batch, kept as a whole)
        assert after[k] < before[k] / (1.5 if name == "1f1b" and k == 0 else 2), (k, before, after)
    stash, held = peaks(full, "stash"), peaks(rec, "stash")
    if name == "pipeoptim":
        # Ŵ of every mini-batch in flight whose forward predicted: 3 on stage 0, 2 on
        # stage 1; the last stage predicts nothing (s = 0)
        weights = {
            k: sum(p.numel() * 4 for p in s.module.parameters()) for k, s in rec.stages.items()
        }
        assert held == {0: stash[0] + 3 * weights[0], 1: stash[1] + 2 * weights[1], 2: 0}
    else:  # the stashed version is kept anyway
        assert held == stash


# -- bad input -------------------------------------------------------------------------------
def test_bad_recompute_requests_name_the_value_and_the_fix() -> None:
    with pytest.raises(RuntimeConfigError, match=r"unknown recompute mode 'most'.*none, full"):
        Pipeline(units(), method="pipeoptim", stages=3, recompute="most")
    with pytest.raises(RuntimeConfigError, match=r"unit 'Conv2d'.*by class \(Dropout, GELU"):
        Pipeline(units(), method="pipeoptim", stages=3, recompute=["Conv2d"])
    with pytest.raises(RuntimeConfigError, match=r"stage 5; stages are 0\.\.2"):
        Pipeline(units(), method="pipeoptim", stages=3, recompute={5: "full"})
    with pytest.raises(RuntimeConfigError, match="stage 0 does not hold"):
        Pipeline(units(), method="pipeoptim", stages=3, recompute={0: ["8"]})
    with pytest.raises(RuntimeConfigError, match="data_parallel is 1; use data_parallel 2"):
        Pipeline(units(), method="pipeoptim", stages=3, shard_optimizer=True)
    with pytest.raises(PlanError, match="one entry per stage \\(2\\), got 3"):
        Plan("pipeoptim", 2, recompute=["full", "none", "none"])
    with pytest.raises(PlanError, match="--recompute 'stages:x'"):
        parse_recompute_flag("stages:x")


def test_a_request_resolves_to_one_entry_per_stage() -> None:
    labels = UnitLabels(("embed", "b0", "b1", "head"), ("Embedding", "Block", "Block", "Linear"))
    bounds = [(0, 2), (2, 4)]
    assert resolve_recompute("full", bounds, labels) == ["full", "full"]
    assert resolve_recompute("none", bounds, labels) is None
    assert resolve_recompute(["Block"], bounds, labels) == [["b0"], ["b1"]]
    assert resolve_recompute(["3"], bounds, labels) == ["none", ["head"]]
    assert resolve_recompute({1: "full"}, bounds, labels) == ["none", "full"]
    assert resolve_recompute(parse_recompute_flag("stages:0"), bounds, labels) == ["full", "none"]
    assert resolve_recompute(["none", ["b1"]], bounds, labels) == ["none", ["b1"]]


def test_a_plan_file_carries_recompute_into_the_pipeline(tmp_path: Path) -> None:
    plan = Plan("pipeoptim", 3, recompute=["full", "none", ["7"]])
    plan.save(tmp_path / "plan.json")
    pipe = Pipeline(units(), plan=Plan.load(tmp_path / "plan.json"))
    recomputed = {k: s.recompute.units if s.recompute else None for k, s in pipe.stages.items()}
    assert recomputed == {0: frozenset({0, 1, 2}), 1: None, 2: frozenset({1})}


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("most", "--recompute 'most' is not understood"),
        ("units:Nope", "recompute names unit 'Nope', which the model does not have"),
    ],
)
def test_the_cli_refuses_a_bad_recompute_in_one_line(flag: str, message: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeoptim",
            "train",
            "--max-steps",
            "2",
            "--quiet",
            "--recompute",
            flag,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# -- a model that fits only with recomputation -------------------------------------------------
CAPPED = """
import json, resource, sys, torch
from torch import nn
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.plan.plan import OptimizerSpec
recompute = None if sys.argv[1] == "none" else sys.argv[1]
torch.set_num_threads(1)
torch.manual_seed(0)
layers = [m for _ in range(24) for m in (nn.Linear(256, 256), nn.GELU())] + [nn.Linear(256, 4)]
g = torch.Generator().manual_seed(1)
data = [
    (torch.randn(4096, 256, generator=g), torch.randint(0, 4, (4096,), generator=g))
    for _ in range(6)
]
# glibc's defaults: the cap counts from what the warm step left mapped, and the tuned
# allocator keeps that step's freed memory mapped (the peak is the same either way)
pipe = Pipeline(
    layers, method="pipeoptim", stages=8, optimizer=OptimizerSpec("sgd", 0.01),
    recompute=recompute, tune_allocator=False,
)
pipe.fit(data[:1], max_steps=1)  # warm: the allocator's arenas, the stages' buffers
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
cap = size + int(sys.argv[2]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
try:
    result = pipe.fit(data, epochs=1)
except Exception as err:  # the stage's error wraps the allocator's
    print(json.dumps({"failed": str(err)[:200]}))
    sys.exit(0)
weights = [p.detach().double().sum().item() for s in pipe.stages.values()
           for p in s.module.parameters()]
print(json.dumps({"losses": result.losses, "weights": weights}))
"""


def capped(recompute: str, headroom_mib: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED, recompute, str(headroom_mib)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(resource, "RLIMIT_AS"), reason="needs RLIMIT_AS")
def test_a_model_over_the_memory_cap_trains_with_recomputation_and_equals_the_uncapped_run() -> (
    None
):
    # Eight stages of three Linear/GELU pairs: a stage's forward saves 6 activations of
    # 4096 x 256 floats (4 MiB each), 24 MiB a mini-batch, and 1F1B keeps 8 + 7 + ... + 1 = 36
    # of them in flight, about 860 MiB. Recomputed, a stage keeps its 4 MiB input per
    # mini-batch in flight (144 MiB) and rebuilds one mini-batch's 24 MiB at a time. Measured
    # here: the recomputed run fits from about 450 MiB over what a first step left mapped,
    # the other needs about 800.
    headroom = 600
    without = capped("none", headroom)
    assert "ran out of memory" in without.get("failed", ""), without
    recomputed = capped("full", headroom)
    assert "losses" in recomputed, recomputed
    uncapped = capped("none", 1 << 16)
    assert recomputed["losses"] == uncapped["losses"]
    assert recomputed["weights"] == uncapped["weights"]


# -- Hugging Face decoders, and their own (reentrant) checkpointing under a split backward ----
def tiny_llama(**config: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            **config,
        )
    )


def token_batches() -> list[tuple[Tensor, Tensor]]:
    ids = torch.randint(0, 61, (4, 4, 9), generator=torch.Generator().manual_seed(5))
    return [(s[:, :-1], s[:, 1:]) for s in ids]


@pytest.mark.parametrize("name", ["pipeoptim", "1f1b"])
def test_a_hugging_face_cut_recomputes_its_decoder_layers_bit_for_bit(name: str) -> None:
    from pipeoptim.hf import cut_causal_lm

    runs = []
    for recompute in (None, "units:DecoderBlock"):
        pipe = Pipeline(
            cut_causal_lm(tiny_llama()),
            method=name,
            stages=2,
            micro_batches=2 if METHODS[name].micro_batched else None,
            recompute=recompute,
        )
        losses = pipe.fit(token_batches(), epochs=1).losses
        runs.append(
            (
                losses,
                [p.detach().clone() for s in pipe.stages.values() for p in s.module.parameters()],
            )
        )
    assert runs[1][0] == runs[0][0]
    assert_same(runs[1][1], runs[0][1])


class Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)
        return out


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_a_split_backward_refuses_reentrant_checkpointing_naming_the_unit(name: str) -> None:
    layers = [nn.Linear(8, 8), Reentrant(), nn.Linear(8, 8), nn.Linear(8, 3)]
    pipe = Pipeline(layers, method=name, stages=2, micro_batches=2, loss_fn=F.cross_entropy)
    data = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(2)]
    with pytest.raises(Exception, match=r"unit 1 \(Reentrant\) uses reentrant activation") as err:
        pipe.fit(data, epochs=1)
    assert "use_reentrant=False" in str(err.value) and "1f1b" in str(err.value)
    # what the message proposes works: pipeoptim's own recomputation of that unit
    layers[1] = nn.Linear(8, 8)
    fixed = Pipeline(layers, method=name, stages=2, micro_batches=2, recompute=["1"])
    assert len(fixed.fit(data, epochs=1).losses) == 2


def test_hugging_face_reentrant_gradient_checkpointing_is_refused_under_zb() -> None:
    from pipeoptim.hf import cut_causal_lm

    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    pipe = Pipeline(cut_causal_lm(model), method="zb-h1", stages=2, micro_batches=2)
    with pytest.raises(Exception, match=r"unit \d+ \(DecoderBlock\) uses reentrant"):
        pipe.fit(token_batches(), epochs=1)


class _OutOfMemoryInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1")


class RunsOutInBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _OutOfMemoryInBackward.apply(x)  # type: ignore[no-untyped-call]
        return out


@pytest.mark.parametrize(("name", "micro"), [("pipeoptim", None), ("zb-h1", 2)])
def test_running_out_of_memory_in_a_backward_says_so_with_the_remedies(
    name: str, micro: int | None
) -> None:
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), RunsOutInBackward(), nn.Linear(8, 3)]
    pipe = Pipeline(layers, method=name, stages=2, micro_batches=micro)
    data = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(2)]
    with pytest.raises(Exception, match=r"stage 1 ran out of memory in a backward") as err:
        pipe.fit(data, epochs=1)
    assert "recompute" in str(err.value) and "--memory-cap" in str(err.value)


class TwiceOneLinear(nn.Module):
    """One Linear reached under two names of one unit (named once per name by torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = self.a

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(torch.tanh(self.a(x)))
        return out


def test_a_unit_holds_one_copy_of_a_weight_it_names_twice() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), TwiceOneLinear(), nn.Linear(16, 4)]
    pipe = Pipeline(layers, method="pipeoptim", stages=2, recompute="full")
    stage = pipe.stages[0]
    weights = sum(p.numel() * 4 for p in stage.module.parameters())  # each tensor once
    assert stage.recompute_held_bytes == weights
