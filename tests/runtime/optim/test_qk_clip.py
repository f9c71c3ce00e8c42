"""QK-Clip (Kimi K2, arXiv 2507.20534) as the ``qk-clip`` delay correction: the recorded max
logit against materialised attention logits, recording that leaves the forward as it was, the
clip against its rule written out literally (γ_h = min(1, τ/S_h); the query and key rows of
head h each by √γ_h, or the query rows alone by γ_h where key heads are shared), on the gpt
workload's attention and on Hugging Face GPT-2 and Llama attention, and the registered
methods training, predicting from the clipped weights and resuming bit for bit."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: no network

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import CORRECTED, METHODS, get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.model.attention_logits import (
    AttentionLogits,
    find_attention,
    max_logits,
)
from pipeoptim.runtime.optim.corrections.protocol import StageContext
from pipeoptim.runtime.optim.corrections.qk_clip import (
    QK_CLIP_THRESHOLD,
    QKClip,
)
from pipeoptim.runtime.optim.corrections.registry import CORRECTIONS
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.result import FitResult
from pipeoptim.workloads.data import Dataset
from pipeoptim.workloads.gpt import AttentionHalf, Block, gpt, lm_loss, python_corpus

HERE = Path(__file__)
VOCAB = 23
DIM, HEADS = 16, 4
HEAD_DIM = DIM // HEADS


# -- helpers ---------------------------------------------------------------------------------
def block(seed: int = 0, gain: float = 8.0) -> Block:
    """A tiny gpt Block whose q and k are scaled up, so its logits are of order 1-10."""
    torch.manual_seed(seed)
    b = Block(DIM, HEADS, 1)
    with torch.no_grad():
        b.qkv.weight[: 2 * DIM].mul_(gain)
        b.qkv.bias.normal_(0.0, 0.5)
    return b


def hidden(batch: int = 3, length: int = 9, seed: int = 1) -> Tensor:
    return torch.randn(batch, length, DIM, generator=torch.Generator().manual_seed(seed))


def causal_logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """The pre-softmax logits a causal softmax sees, (B, H, T, T), −inf above the diagonal."""
    s = q @ k.transpose(-1, -2) * scale
    t = s.shape[-1]
    return s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)


def block_logits(b: Block | AttentionHalf, x: Tensor) -> Tensor:
    """The literal per-head max logit of the block's attention on ``x``, materialised."""
    bsz, t, d = x.shape
    with torch.no_grad():
        q, k, _ = b.qkv(b.norm1(x)).split(d, dim=2)
        q, k = (z.view(bsz, t, HEADS, HEAD_DIM).transpose(1, 2) for z in (q, k))
        return causal_logits(q, k, HEAD_DIM**-0.5).amax(dim=(0, 2, 3))


def context(module: nn.Module, method: str = "pipeoptim+qk-clip") -> StageContext:
    return StageContext(0, 2, method, 1, 1, module=module)


def trained_forward(module: nn.Module, x: Tensor) -> Tensor:
    module.train()
    out: Tensor = module(x)
    return out


@pytest.fixture
def tau(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Register qk-clip with another τ (the documented way) for this test."""

    def use(threshold: float) -> None:
        monkeypatch.setitem(CORRECTIONS, "qk-clip", lambda c, o: QKClip(c, o, threshold=threshold))

    return use


# -- the methods -----------------------------------------------------------------------------
def test_the_methods_name_their_base_and_the_correction() -> None:
    assert {"pipedream+qk-clip", "pipeoptim+qk-clip"} <= CORRECTED
    for name in ("pipedream+qk-clip", "pipeoptim+qk-clip"):
        method, base = METHODS[name], get_method(name.split("+")[0])
        assert method.delay_correction == "qk-clip" and method.corrects == base.name
        assert (method.weight_policy, method.prediction_rule) == (
            base.weight_policy,
            base.prediction_rule,
        )
        assert "τ = 100" in method.description
    assert QK_CLIP_THRESHOLD == 100.0  # Kimi K2's


# -- recording -------------------------------------------------------------------------------
@pytest.mark.parametrize("half", [False, True])
def test_the_recorded_max_logit_is_the_causal_softmaxs_largest_logit(half: bool) -> None:
    b = block()
    unit: Block | AttentionHalf = AttentionHalf(b) if half else b
    x = hidden()
    unit.attention_logits.start(unit)
    trained_forward(unit, x)
    assert unit.attention_logits.peak is not None
    torch.testing.assert_close(unit.attention_logits.peak, block_logits(unit, x))
    # a second forward folds in: the max over both batches, until taken
    y = hidden(seed=2) * 3
    trained_forward(unit, y)
    both = torch.maximum(block_logits(unit, x), block_logits(unit, y))
    torch.testing.assert_close(unit.attention_logits.take(), both)
    assert unit.attention_logits.peak is None


def test_recording_leaves_the_forward_and_its_gradients_bitwise_as_they_were() -> None:
    x = hidden()
    runs = []
    for record in (False, True):
        b = block()
        if record:
            b.attention_logits.start(b)
        out = trained_forward(b, x)
        out.square().sum().backward()
        runs.append((out.detach(), [p.grad.clone() for p in b.parameters()]))  # type: ignore[union-attr]
        assert (b.attention_logits.peak is not None) == record
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, c) for a, c in zip(runs[0][1], runs[1][1], strict=True))


def test_recording_is_off_by_default_and_skips_eval_and_no_grad_forwards() -> None:
    b = block()
    trained_forward(b, hidden())
    assert not b.attention_logits.recording and b.attention_logits.peak is None
    b.attention_logits.start(b)
    with torch.no_grad():
        b(hidden())  # the pipeline's dry run
    b.eval()
    b(hidden())  # evaluation
    assert b.attention_logits.peak is None


def test_max_logits_reads_masks_and_shared_key_heads() -> None:
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    full = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3
    allowed = torch.rand(2, 1, 5, 5, generator=g) > 0.4
    allowed |= torch.eye(5, dtype=torch.bool)
    expected = full.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_logits(q, k, 0.3, allowed), expected)
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    torch.testing.assert_close(max_logits(q, k, 0.3, additive), expected)
    torch.testing.assert_close(max_logits(q, k, 0.3, causal=False), full.amax(dim=(0, 2, 3)))


# -- the clip, literally ---------------------------------------------------------------------
def test_the_clip_is_kimi_k2s_rule_head_by_head() -> None:
    """γ_h = min(1, τ/S_h); head h's query rows and key rows of ``qkv`` (weight and bias)
    each times √γ_h; the value rows, the other heads and every other tensor untouched."""
    b = block()
    x = hidden()
    peaks = block_logits(b, x)
    threshold = float(peaks.median())  # two heads over τ, two under
    before = {n: p.detach().clone() for n, p in b.named_parameters()}
    clip = QKClip(context(b), torch.optim.SGD(b.parameters(), lr=0.1), threshold=threshold)
    trained_forward(b, x)
    clip.after_step(torch.optim.SGD(b.parameters(), lr=0.1), list(b.parameters()), 1)
    over = [h for h in range(HEADS) if float(peaks[h]) > threshold]
    assert 0 < len(over) < HEADS
    weight, bias = before["qkv.weight"].clone(), before["qkv.bias"].clone()
    for h in over:
        root = math.sqrt(threshold / float(peaks[h]))
        for start in (h * HEAD_DIM, DIM + h * HEAD_DIM):  # its query rows, its key rows
            weight[start : start + HEAD_DIM] *= root
            bias[start : start + HEAD_DIM] *= root
    torch.testing.assert_close(b.qkv.weight, weight, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.qkv.bias, bias, rtol=1e-6, atol=0)
    assert torch.equal(b.qkv.weight[2 * DIM :], before["qkv.weight"][2 * DIM :])  # values
    assert all(torch.equal(p, before[n]) for n, p in b.named_parameters() if "qkv" not in n)
    assert clip.clips == len(over)
    assert clip.latest[0] is not None
    torch.testing.assert_close(clip.latest[0], peaks)


def test_after_the_clip_the_next_forwards_max_logit_is_at_most_tau() -> None:
    b = block()
    x = hidden()
    peaks = block_logits(b, x)
    threshold = float(peaks.min()) * 0.5  # every head over τ
    clip = QKClip(context(b), torch.optim.SGD(b.parameters(), lr=0.1), threshold=threshold)
    trained_forward(b, x)
    clip.after_step(torch.optim.SGD(b.parameters(), lr=0.1), list(b.parameters()), 1)
    trained_forward(b, x)
    again = b.attention_logits.take()
    assert again is not None
    assert bool((again <= threshold * (1 + 1e-5)).all()), (again, threshold)
    torch.testing.assert_close(again, torch.full_like(again, threshold))  # exactly γ·S


def test_the_max_is_taken_over_the_replicas_before_clipping() -> None:
    """Under data parallelism S_h is the max over every replica's share of the batch: a
    replica whose own logits are under τ still clips the heads another replica saw over it."""
    b = block()
    x = hidden()
    peaks = block_logits(b, x)
    clip = QKClip(context(b), torch.optim.SGD(b.parameters(), lr=0.1), threshold=1e6)
    other = torch.full((HEADS,), 2e6)  # what the other replica recorded
    clip.replica_max = lambda t: t.copy_(torch.maximum(t, other))
    weight = b.qkv.weight.detach().clone()
    trained_forward(b, x)
    clip.after_step(torch.optim.SGD(b.parameters(), lr=0.1), list(b.parameters()), 1)
    assert peaks.max() < 1e6 and clip.clips == HEADS
    torch.testing.assert_close(b.qkv.weight[:DIM], weight[:DIM] * math.sqrt(0.5))


def test_a_stage_without_attention_has_nothing_to_clip_and_silent_attention_is_refused() -> None:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Embedding(3, 4))
    clip = QKClip(context(mlp), torch.optim.SGD(mlp.parameters(), lr=0.1))
    assert clip.units == []
    clip.after_step(torch.optim.SGD(mlp.parameters(), lr=0.1), list(mlp.parameters()), 1)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    with pytest.raises(RuntimeConfigError) as err:
        Pipeline(
            [nn.Linear(8, 8), layer],
            method="pipeoptim+qk-clip",
            stages=2,
            loss_fn=F.mse_loss,
            optimizer=OptimizerSpec("adamw", 1e-3),
        )
    said = str(err.value)
    for words in ("stage 1", "pipeoptim+qk-clip", "τ = 100", "MultiheadAttention", "record(q, k"):
        assert words in said, said
    assert "without +qk-clip" in said


def test_an_exposing_attention_that_records_nothing_is_refused_at_its_update() -> None:
    b = block()
    clip = QKClip(context(b), torch.optim.SGD(b.parameters(), lr=0.1))
    with pytest.raises(RuntimeConfigError, match="recorded none"):
        clip.after_step(torch.optim.SGD(b.parameters(), lr=0.1), list(b.parameters()), 1)


def test_find_attention_looks_into_wrappers_but_not_into_exposing_modules() -> None:
    class AttnBlock(nn.Module):  # a user's wrapper named like attention, around a Block
        def __init__(self) -> None:
            super().__init__()
            self.inner = block()

    exposing, silent = find_attention(nn.Sequential(AttnBlock(), nn.Linear(2, 2)))
    assert [n for n, _, _ in exposing] == ["0.inner"] and silent == []


# -- Hugging Face ------------------------------------------------------------------------------
def _hf_models() -> dict[str, Callable[[], Any]]:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                **small,
                n_layer=2,
                n_embd=DIM,
                n_head=HEADS,
                n_positions=16,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                **small,
                hidden_size=DIM,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=HEADS,
                num_key_value_heads=2,
                max_position_embeddings=16,
            )
        ),
    }


def _hf_reference(model: Any, ids: Tensor) -> list[Tensor]:
    """Each layer's per-head max logit, materialised from the layer's own modules: its input
    norm, its projections, transformers' own rotary embedding (Llama), the scaling."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    inputs: list[Tensor] = []
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    handles = [
        layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in layers
    ]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    out = []
    with torch.no_grad():
        for layer, x in zip(layers, inputs, strict=True):
            b, t, _ = x.shape
            if hasattr(layer, "attn"):  # GPT-2
                attn = layer.attn
                q, k, _ = attn.c_attn(layer.ln_1(x)).split(DIM, dim=2)
                q, k = (z.view(b, t, -1, attn.head_dim).transpose(1, 2) for z in (q, k))
            else:
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
                k = attn.k_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
                positions = torch.arange(t).unsqueeze(0)
                cos, sin = model.model.rotary_emb(h, positions)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                k = repeat_kv(k, attn.num_key_value_groups)
            out.append(causal_logits(q, k, attn.scaling).amax(dim=(0, 2, 3)))
    return out


def _hf_attention(model: Any) -> list[nn.Module]:
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return [layer.attn if hasattr(layer, "attn") else layer.self_attn for layer in layers]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_attention_records_its_max_logit(name: str) -> None:
    from pipeoptim.hf import LOGITS_ATTENTION, cut_causal_lm

    torch.manual_seed(0)
    model = _hf_models()[name]()
    cut = cut_causal_lm(model)
    attention = _hf_attention(model)
    assert all(a.config._attn_implementation == "sdpa" for a in attention)  # untouched
    with torch.no_grad():
        for a in attention:
            for proj in ("c_attn", "q_proj", "k_proj"):
                if hasattr(a, proj):
                    getattr(a, proj).weight.mul_(6.0)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(4))
    model.train()
    with torch.no_grad():
        plain = model(ids).logits
    expected = _hf_reference(model, ids)
    for a in attention:
        a.attention_logits.start(a)
        assert a.config._attn_implementation == LOGITS_ATTENTION
    assert model.config._attn_implementation == "sdpa"  # the masks' config is the model's
    units = list(cut.units)
    x: Any = ids
    for unit in units:
        unit.train()
        x = unit(x)
    assert torch.equal(x.detach(), plain)  # recording leaves the logits as they were
    for a, want in zip(attention, expected, strict=True):
        assert a.attention_logits.peak is not None
        torch.testing.assert_close(a.attention_logits.peak, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_clip_follows_the_rule_and_brings_the_logits_to_tau(name: str) -> None:
    """GPT-2 (its own key heads): ``c_attn``'s query and key columns of head h, and their
    bias, times √γ_h. Llama with 4 query heads on 2 key heads (grouped-query attention):
    ``q_proj``'s rows of head h times γ_h, ``k_proj`` untouched. Either way the next
    forward's max logit of a clipped head is τ (on the same input)."""
    from pipeoptim.hf import cut_causal_lm

    torch.manual_seed(0)
    model = _hf_models()[name]()
    cut = cut_causal_lm(model)
    attention = _hf_attention(model)
    with torch.no_grad():
        for a in attention:
            for proj in ("c_attn", "q_proj", "k_proj"):
                if hasattr(a, proj):
                    getattr(a, proj).weight.mul_(6.0)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(4))
    peaks = _hf_reference(model, ids)
    threshold = float(torch.stack(peaks).median())
    first = attention[0]
    before = {n: p.detach().clone() for n, p in first.named_parameters()}
    clip = QKClip(
        context(nn.ModuleList(cut.units)),
        torch.optim.SGD(model.parameters(), lr=0.1),
        threshold=threshold,
    )
    assert len(clip.units) == 2
    model.train()
    model(ids)
    clip.after_step(torch.optim.SGD(model.parameters(), lr=0.1), [], 1)
    gamma = [min(1.0, threshold / float(s)) for s in peaks[0]]
    if name == "gpt2":
        weight, bias = before["c_attn.weight"].clone(), before["c_attn.bias"].clone()
        for h, g in enumerate(gamma):
            for start in (h * HEAD_DIM, DIM + h * HEAD_DIM):
                weight[:, start : start + HEAD_DIM] *= math.sqrt(g)
                bias[start : start + HEAD_DIM] *= math.sqrt(g)
        torch.testing.assert_close(first.c_attn.weight, weight, rtol=1e-6, atol=0)
        torch.testing.assert_close(first.c_attn.bias, bias, rtol=1e-6, atol=0)
    else:
        weight = before["q_proj.weight"].clone()
        for h, g in enumerate(gamma):
            weight[h * HEAD_DIM : (h + 1) * HEAD_DIM] *= g
        torch.testing.assert_close(first.q_proj.weight, weight, rtol=1e-6, atol=0)
        assert torch.equal(first.k_proj.weight, before["k_proj.weight"])
    assert 0 < clip.clips < 2 * HEADS
    # the first layer's input is as it was (the later ones' moved with the clip before them)
    after = _hf_reference(model, ids)[0]
    expected = torch.minimum(peaks[0], torch.tensor(threshold))
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


def test_a_llama_cut_trains_under_pipeoptim_with_qk_clip(tau: Callable[[float], None]) -> None:
    from pipeoptim.hf import cut_causal_lm

    torch.manual_seed(0)
    model = _hf_models()["llama"]()
    tau(0.005)  # the fresh model's logits are about 0.02
    pipe = Pipeline(cut_causal_lm(model), method="pipeoptim+qk-clip", stages=2, progress=False)
    ids = torch.randint(0, VOCAB, (4, 4, 9), generator=torch.Generator().manual_seed(5))
    result = pipe.fit([(s[:, :-1], s[:, 1:]) for s in ids], max_steps=4)
    assert all(math.isfinite(loss) for loss in result.losses)
    clips = [s.updater.correction.clips for s in pipe.stages.values()]  # type: ignore[union-attr]
    assert all(c > 0 for c in clips), clips


def test_qwen3s_normalised_attention_exposes_no_logits_and_is_refused() -> None:
    """Qwen3 normalises q and k per head with weights every head shares (``q_norm``), so no
    per-head rescale of its projections moves its logits."""
    transformers = pytest.importorskip("transformers")
    from pipeoptim.hf import cut_causal_lm

    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
    )
    cut = cut_causal_lm(transformers.Qwen3ForCausalLM(config))
    with pytest.raises(RuntimeConfigError, match=r"stage 0: .*Qwen3Attention\) exposes no logits"):
        Pipeline(cut, method="pipeoptim+qk-clip", stages=2, progress=False)


# -- the pipeline ----------------------------------------------------------------------------
@functools.cache
def corpus_batches(n: int, batch: int = 8, context_len: int = 16) -> list[tuple[Tensor, Tensor]]:
    data = python_corpus(context=context_len, train_chars=20_000, test_chars=2_000)
    return [
        (data.train_x[i * batch : (i + 1) * batch], data.train_y[i * batch : (i + 1) * batch])
        for i in range(n)
    ]


def gpt_pipeline(method: str, optimizer: OptimizerSpec, stages: int = 3) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        gpt(context=16, dim=32, heads=4, blocks=2),
        method=method,
        stages=stages,
        optimizer=optimizer,
        loss_fn=lm_loss,
        progress=False,
    )


@pytest.mark.parametrize("method", ["pipeoptim+qk-clip", "pipedream+qk-clip"])
def test_the_gpt_workload_trains_and_its_clip_fires(
    method: str, tau: Callable[[float], None]
) -> None:
    tau(0.02)
    pipe = gpt_pipeline(method, OptimizerSpec("adamw", 2e-3))
    result = pipe.fit(corpus_batches(24), max_steps=24)
    losses = result.losses
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-4:]) / 4 < losses[0] - 0.3, losses
    for stage in pipe.stages.values():
        correction = stage.updater.correction  # type: ignore[union-attr]
        assert isinstance(correction, QKClip)
        blocks = [m for m in stage.module if isinstance(m, Block)]
        assert len(correction.units) == len(blocks)
        if blocks:
            assert correction.clips > 0
            assert stage.state_dict()["correction"]["clipped"] == correction.clips


def test_the_predicted_forward_reads_the_clipped_weights_plus_the_prediction(
    tau: Callable[[float], None],
) -> None:
    """pipeoptim under SGD with momentum: after each update stage 0's attention is clipped,
    and its next forward runs on Ŵ = clip(W) − lr·s·m (the momentum buffer), literally."""
    tau(0.02)
    lr = 0.05
    pipe = gpt_pipeline("pipeoptim+qk-clip", OptimizerSpec("sgd", lr, {"momentum": 0.9}), 2)
    stage = pipe.stages[0]
    correction, optimizer = stage.updater.correction, stage.optimizer  # type: ignore[union-attr]
    assert isinstance(correction, QKClip) and optimizer is not None
    params = list(stage._params)
    clipped: list[list[Tensor]] = []
    moved: list[bool] = []
    original_after = correction.after_step

    def after_step(opt: torch.optim.Optimizer, ps: Sequence[Tensor], delay: int) -> None:
        unclipped = [p.detach().clone() for p in params]
        original_after(opt, ps, delay)
        clipped.append([p.detach().clone() for p in params])
        moved.append(
            any(not torch.equal(a, b) for a, b in zip(unclipped, clipped[-1], strict=True))
        )

    checked: list[int] = []
    original_write = stage._write_prediction

    def write_prediction(s: int) -> list[Tensor]:
        predicted = original_write(s)
        if clipped:
            for p, w, hat in zip(params, clipped[-1], predicted, strict=True):
                assert torch.equal(p.detach(), w)  # the live weights are the clipped ones
                m = optimizer.state[p]["momentum_buffer"]
                torch.testing.assert_close(hat, w - lr * s * m, rtol=1e-6, atol=1e-7)
            checked.append(s)
        return predicted

    correction.after_step = after_step  # type: ignore[method-assign]
    stage._write_prediction = write_prediction  # type: ignore[method-assign]
    pipe.fit(corpus_batches(6), max_steps=6)
    assert checked and all(s >= 1 for s in checked)
    # every update clipped but the drain's last, which follows no forward: nothing measured
    assert moved == [True] * 5 + [False]


# -- resume ----------------------------------------------------------------------------------
def tiny_gpt() -> list[nn.Module]:
    """The model of the resume test (``pipeoptim train --model tests/test_qk_clip.py:...``)."""
    return gpt(vocab_size=VOCAB, context=8, dim=16, heads=2, blocks=2)


def dataset() -> Dataset:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (90, 9), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return Dataset("ids", x[:80], y[:80], x[80:], y[80:], VOCAB)


loss = lm_loss


def _config(tmp: Path, steps: int, method: str, resume: bool = False) -> TrainConfig:
    plan = Plan(
        method,
        3,
        micro_batches=1,
        optimizer=OptimizerSpec("adamw", 5e-3),
        model=f"{HERE}:tiny_gpt",
        batch_size=8,
    )
    return TrainConfig(
        plan,
        max_steps=steps,
        checkpoint_dir=str(tmp),
        checkpoint_every=4,
        resume=resume,
        device="cpu",
    )


def _same(a: object, b: object) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _saved(folder: Path) -> Iterator[dict[str, Any]]:
    from pipeoptim.runtime.checkpoint.store import latest_step

    step = latest_step(folder)
    assert step is not None
    for k in range(3):
        yield torch.load(folder / f"step-{step['step']:08d}" / f"stage-{k}.pt", weights_only=True)


@pytest.mark.parametrize("method", ["pipeoptim+qk-clip", "pipedream+qk-clip"])
def test_a_resumed_run_equals_the_uninterrupted_one(
    tmp_path: Path, method: str, tau: Callable[[float], None]
) -> None:
    from pipeoptim.workloads.train import train

    tau(0.05)
    whole = train(_config(tmp_path / "a", 12, method))
    first = train(_config(tmp_path / "b", 8, method))
    rest = train(_config(tmp_path / "b", 12, method, resume=True))
    assert isinstance(whole, FitResult) and isinstance(first, FitResult)
    assert isinstance(rest, FitResult) and (rest.start_step, rest.end_step) == (8, 12)
    assert first.losses + rest.losses == whole.losses  # bit for bit
    states = list(zip(_saved(tmp_path / "a"), _saved(tmp_path / "b"), strict=True))
    for a, b in states:
        assert _same(a["state"], b["state"])
    clipped = [a["state"]["correction"]["clipped"] for a, _ in states]
    assert sum(clipped) > 0, clipped  # the clip fired on the attention


def test_attention_logits_refuses_rows_that_do_not_cover_the_heads() -> None:
    from pipeoptim.runtime.model.attention_logits import HeadRows

    with pytest.raises(RuntimeConfigError, match="cover the 4 query heads"):
        AttentionLogits(4, [HeadRows("qkv.weight", 0, 0, 2, 4)], [])


# -- data parallelism ------------------------------------------------------------------------
REPLICA_MODEL = """
import torch
from pipeoptim.runtime.optim.corrections.qk_clip import QKClip
from pipeoptim.runtime.optim.corrections.registry import CORRECTIONS
from pipeoptim.workloads.data import Dataset
from pipeoptim.workloads.gpt import gpt, lm_loss

# another τ, in every process: at the top of the model's module (docs/choosing-a-method.md)
CORRECTIONS["qk-clip"] = lambda context, optimizer: QKClip(context, optimizer, threshold=0.02)


def make():
    return gpt(vocab_size=23, context=8, dim=16, heads=2, blocks=2)


def dataset():
    ids = torch.randint(0, 23, (90, 9), generator=torch.Generator().manual_seed(2))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return Dataset("ids", x[:80], y[:80], x[80:], y[80:], 23)


loss = lm_loss
"""


@pytest.mark.slow
def test_two_replicas_clip_as_one_process_on_the_full_batch(tmp_path: Path) -> None:
    """``pipeoptim train --data-parallel 2`` (4 processes over gloo): each replica's S_h is
    the max over both replicas' halves of the batch, which is the full batch's, so the run
    clips the heads one process does and ends at its weights (measured: 6e-6 apart)."""
    import shlex
    import subprocess
    import sys

    (tmp_path / "replica_model.py").write_text(REPLICA_MODEL)
    states = []
    model = f"{tmp_path / 'replica_model.py'}:make"
    common = shlex.split(
        "train --method pipeoptim+qk-clip --stages 2 --max-steps 10 --optimizer adamw "
        "--lr 5e-3 --batch-size 8 --device cpu --quiet"
    )
    for name, extra in (("dp", ["--data-parallel", "2"]), ("one", [])):
        folder_args = ["--model", model, "--checkpoint-dir", str(tmp_path / name)]
        subprocess.run(
            [sys.executable, "-m", "pipeoptim", *common, *folder_args, *extra],
            check=True,
            capture_output=True,
            timeout=600,
            cwd=HERE.parents[3],
        )
        folder = tmp_path / name / "step-00000010"
        states.append(
            [torch.load(folder / f"stage-{k}.pt", weights_only=True)["state"] for k in (0, 1)]
        )
    for dp, one in zip(*states, strict=True):
        assert dp["correction"]["clipped"] == one["correction"]["clipped"]
        for key, tensor in one["module"].items():
            torch.testing.assert_close(dp["module"][key], tensor, rtol=0, atol=1e-4)
    assert states[1][0]["correction"]["clipped"] > 0
