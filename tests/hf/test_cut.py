"""``pipeoptim.hf``: Hugging Face causal LMs cut into pipeline units compute the model's own
logits and loss, are named as the model names its tensors, initialise on the meta device by
the model's own init, train through a Pipeline, and export to a ``from_pretrained`` folder."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import FOLDER

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: no network

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipeoptim import Pipeline  # noqa: E402
from pipeoptim.errors import RuntimeConfigError  # noqa: E402
from pipeoptim.hf import (  # noqa: E402
    KNOWN_MODELS,
    causal_lm_loss,
    cut_causal_lm,
    save_pretrained_folder,
)

VOCAB = 101
ROOT = Path(__file__).resolve().parents[2]
SMALL = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
ROTARY = {
    **SMALL,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def gpt2(tied: bool = False, dropout: float = 0.1) -> Any:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            **SMALL,
            n_layer=2,
            n_embd=32,
            n_head=2,
            n_positions=32,
            tie_word_embeddings=tied,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
    )


def llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**ROTARY))


def qwen2() -> Any:
    # the last layer slides (window 4 < 12 tokens): its unit must make that mask
    config = transformers.Qwen2Config(
        **ROTARY, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    return transformers.Qwen2ForCausalLM(config)


def mistral() -> Any:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**ROTARY, sliding_window=4))


def qwen3() -> Any:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**ROTARY, head_dim=8))


MODELS: dict[str, Callable[[], Any]] = {
    "gpt2-untied": gpt2,
    "gpt2-tied": lambda: gpt2(tied=True),
    "llama": llama,
    "llama-tied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**ROTARY, tie_word_embeddings=True)
    ),
    "qwen2": qwen2,
    "mistral": mistral,
    "qwen3": qwen3,
}


def ids(batch: int = 3, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def chained(units: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for unit in units:
        x = unit(x)
    return x


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


def test_known_models_are_the_cut_families() -> None:
    assert set(KNOWN_MODELS) == {
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }


@pytest.mark.parametrize("name", sorted(MODELS))
def test_units_chained_give_the_models_own_logits(name: str) -> None:
    model = MODELS[name]().eval()
    cut = cut_causal_lm(model)
    assert len(cut.units) == model.config.num_hidden_layers + 2
    x = ids()
    with torch.no_grad():
        hidden = cut.units[0](x)
        assert hidden.shape == (3, 12, 32)
        for block in cut.units[1:-1]:
            assert block(hidden).shape == hidden.shape
        torch.testing.assert_close(chained(cut.units, x), model(x).logits)


def test_sliding_window_layers_get_their_own_mask() -> None:
    """The Qwen2 model above mixes full and sliding layers: the units follow layer_types."""
    cut = cut_causal_lm(qwen2())
    makers = [block.make_mask.__name__ for block in cut.units[1:-1]]
    assert makers == ["create_causal_mask", "create_sliding_window_causal_mask"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_names_are_the_models_state_dict_keys(name: str) -> None:
    model = MODELS[name]()
    cut = cut_causal_lm(model)
    keys = set(model.state_dict())
    named = {k for unit in cut.names or [] for names in unit.values() for k in names}
    assert named == keys  # every tensor of the model is in some unit, under its real name
    for unit, names in zip(cut.units, cut.names or [], strict=True):
        assert set(names) == set(unit.state_dict())


@pytest.mark.parametrize("name", ["gpt2-tied", "llama-tied"])
def test_tied_embedding_is_one_parameter_in_first_and_last_unit(name: str) -> None:
    model = MODELS[name]()
    cut = cut_causal_lm(model)
    first, last = cut.units[0], cut.units[-1]
    embedding = first.wte.weight if hasattr(first, "wte") else first.weight
    assert last.lm_head.weight is embedding
    assert len(cut.names[-1]["lm_head.weight"]) == 2  # type: ignore[index]


def test_tied_embedding_built_on_meta_is_one_parameter() -> None:
    cut = cut_causal_lm(_meta(lambda: gpt2(tied=True)))
    assert cut.units[-1].lm_head.weight is cut.units[0].wte.weight


def test_untied_gpt2_holds_two_parameters() -> None:
    cut = cut_causal_lm(gpt2(tied=False))
    assert cut.units[-1].lm_head.weight is not cut.units[0].wte.weight
    assert cut.names[-1]["lm_head.weight"] == ["lm_head.weight"]  # type: ignore[index]


def test_rotary_embedding_is_the_models_own_shared_by_every_block() -> None:
    model = llama()
    cut = cut_causal_lm(model)
    assert all(block.rotary_emb is model.model.rotary_emb for block in cut.units[1:-1])


def test_source_loss_and_cache() -> None:
    model = gpt2()
    assert model.config.use_cache
    cut = cut_causal_lm(model)
    assert cut.source["library"] == "transformers"
    assert cut.source["class"] == "GPT2LMHeadModel"
    assert cut.source["config"]["n_layer"] == 2
    assert cut.source["config"]["use_cache"] is True  # the export keeps the user's setting
    assert model.config.use_cache is True  # left as the user set it (issue 33, item 14)
    assert cut.loss_fn is causal_lm_loss


def test_loss_does_not_shift_and_ignores_minus_100() -> None:
    logits = torch.randn(2, 5, VOCAB)
    targets = torch.randint(0, VOCAB, (2, 5))
    want = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    torch.testing.assert_close(causal_lm_loss(logits, targets), want)
    targets[:, -1] = -100
    kept = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets[:, :-1].ravel())
    torch.testing.assert_close(causal_lm_loss(logits, targets), kept)


def test_loss_equals_the_models_own_shifted_loss() -> None:
    model = llama().eval()
    cut = cut_causal_lm(model)
    seq = ids(length=13)
    with torch.no_grad():
        own = model(seq, labels=seq).loss
        ours = causal_lm_loss(chained(cut.units, seq[:, :-1]), seq[:, 1:])
    torch.testing.assert_close(ours, own)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: nn.Linear(2, 2), id="plain-module"),
        pytest.param(
            lambda: transformers.BertForMaskedLM(
                transformers.BertConfig(
                    vocab_size=VOCAB,
                    hidden_size=16,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=32,
                )
            ),
            id="bert",
        ),
    ],
)
def test_unknown_model_is_refused_naming_the_known_ones(model: Callable[[], nn.Module]) -> None:
    with pytest.raises(RuntimeConfigError) as err:
        cut_causal_lm(model())
    message = str(err.value)
    assert all(known in message for known in KNOWN_MODELS)
    assert "ModelUnits.from_model" in message


def test_cross_attention_gpt2_is_refused() -> None:
    config = transformers.GPT2Config(**SMALL, n_layer=1, n_embd=16, n_head=2)
    config.add_cross_attention = True
    with pytest.raises(RuntimeConfigError, match="add_cross_attention=False"):
        cut_causal_lm(transformers.GPT2LMHeadModel(config))


def test_too_long_sequence_is_refused_with_the_limit() -> None:
    cut = cut_causal_lm(gpt2())
    with pytest.raises(RuntimeConfigError, match=r"33 tokens.*32 positions"):
        cut.units[0](torch.zeros(1, 33, dtype=torch.long))


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(RuntimeConfigError, match=r"pip install pipeoptim\[hf\]"):
        save_pretrained_folder({"library": "transformers"}, {}, "unused")


def test_module_imports_without_transformers() -> None:
    code = "import sys, pipeoptim.hf; assert 'transformers' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


# -- initialisation on the meta device ----------------------------------------------------
def _meta(build: Callable[[], Any]) -> Any:
    with torch.device("meta"):
        return build()


@pytest.mark.parametrize("name", ["gpt2-untied", "gpt2-tied", "llama", "qwen2"])
def test_meta_units_materialise_by_the_models_own_init(name: str) -> None:
    """Each tensor of a unit materialised from a meta model is drawn as the model draws it
    when built normally: the same constants, the same spread (GPT-2 scales its residual
    projections by 1/sqrt(2 n_layer) from transformers 5.15 on, not before: whichever the
    installed version does), the same rotary buffers."""
    build = MODELS[name]
    reference = build()
    built = {**dict(reference.named_buffers()), **reference.state_dict(keep_vars=True)}
    meta_model = _meta(build)
    cut = cut_causal_lm(meta_model)
    assert cut.init_weights is not None
    std = meta_model.config.initializer_range
    # non-persistent buffers (rotary inv_freq, GPT-2's causal bias in transformers 5.0) have
    # no state_dict name: find theirs in the model while the tensors are still the model's
    model_buffers = {id(b): key for key, b in meta_model.named_buffers()}
    buffer_names = [{k: model_buffers[id(b)] for k, b in u.named_buffers()} for u in cut.units]
    for index, unit in enumerate(cut.units):
        unit.to_empty(device="cpu")
        with torch.no_grad():  # what to_empty left may look fine: make it plainly wrong
            for t in [*unit.parameters(), *unit.buffers()]:
                t.fill_(math.nan)
        torch.manual_seed(index)
        cut.init_weights(index, unit)
        for key, b in unit.named_buffers():
            want = built[buffer_names[index][key]]
            torch.testing.assert_close(b, want, rtol=0, atol=0, msg=f"unit {index} {key}")
        names = cut.unit_names(index)
        for key, p in unit.named_parameters():
            where = f"unit {index} {key}"
            assert torch.isfinite(p).all(), where
            want = built[names[key][0]]
            if p.dim() == 1:  # norms and biases: constants
                torch.testing.assert_close(p, want, rtol=0, atol=0, msg=where)
            else:  # drawn: compare the spread, which is about the initializer range
                spread = want.std().item()
                assert 0.25 * std < spread < 1.5 * std, where
                assert abs(p.std().item() - spread) < 0.25 * spread, where
                assert abs(p.mean().item()) < 0.2 * spread, where
    x = ids()
    with torch.no_grad():
        assert torch.isfinite(chained(cut.units, x)).all()


def test_meta_init_is_seeded_and_keeps_no_model() -> None:
    meta_model = _meta(gpt2)
    cut = cut_causal_lm(meta_model)
    assert cut.init_weights is not None
    unit = cut.units[1]
    unit.to_empty(device="cpu")
    draws = []
    for _ in range(2):  # the first call builds the init twin: it draws nothing
        torch.manual_seed(5)
        cut.init_weights(1, unit)
        draws.append(unit.layer.attn.c_attn.weight.detach().clone())
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)
    held = [cell.cell_contents for cell in cut.init_weights.__closure__ or ()]
    assert not any(isinstance(h, nn.Module) for h in held)
    twins = [t for h in held if isinstance(h, list) for t in h]
    assert twins and all(p.is_meta for twin in twins for p in twin.parameters())


# -- training through the pipeline --------------------------------------------------------
@pytest.mark.parametrize("method", ["zb-h1", "pipeoptim"])
def test_untied_gpt2_trains_through_the_pipeline(method: str) -> None:
    model = gpt2(tied=False, dropout=0.0)  # no dropout: the first loss is the model's own
    cut = cut_causal_lm(model)
    sequences = [ids(batch=4, length=17, seed=s) for s in range(4)]
    batches = [(s[:, :-1], s[:, 1:]) for s in sequences]
    with torch.no_grad():
        own = model(sequences[0], labels=sequences[0]).loss.item()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sizes = {"micro_batches": 2} if method != "pipeoptim" else {}  # pipeoptim: one unit each
    pipe = Pipeline(
        cut.units,
        method=method,
        stages=2,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        loss_fn=cut.loss_fn,
        **sizes,
    )
    result = pipe.fit(batches, max_steps=4)
    assert len(result.losses) == 4
    assert all(math.isfinite(loss) for loss in result.losses)
    assert result.losses[0] == pytest.approx(own, abs=1e-5)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == sorted(before)  # every tensor of the model trained


# -- export ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2-untied", "gpt2-tied", "llama", "qwen2"])
def test_save_pretrained_folder_round_trip(name: str, tmp_path: Path) -> None:
    model = MODELS[name]().eval()
    cut = cut_causal_lm(model)
    path = save_pretrained_folder(cut.source, model.state_dict(), tmp_path / "out")
    assert (path / "config.json").is_file()
    assert list(path.glob("*.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(loaded) is type(model)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_save_pretrained_folder_takes_a_tied_tensor_under_one_name(tmp_path: Path) -> None:
    model = gpt2(tied=True).eval()
    cut = cut_causal_lm(model)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        save_pretrained_folder(cut.source, state, tmp_path)
    ).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("transformer.wpe.weight"), r"missing.*transformer\.wpe\.weight"),
        (lambda s: s.update(extra=torch.zeros(1)), r"unexpected.*extra"),
        (
            lambda s: s.update({"lm_head.weight": s["lm_head.weight"] + 1}),
            "tied but different",
        ),
    ],
    ids=["missing", "unexpected", "tied-unequal"],
)
def test_save_pretrained_folder_refuses_a_state_dict_that_does_not_fit(
    change: Callable[[dict[str, torch.Tensor]], object], message: str, tmp_path: Path
) -> None:
    model = gpt2(tied=True)
    cut = cut_causal_lm(model)
    state = dict(model.state_dict())
    change(state)
    with pytest.raises(RuntimeConfigError, match=message):
        save_pretrained_folder(cut.source, state, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


def test_save_pretrained_folder_refuses_another_source(tmp_path: Path) -> None:
    with pytest.raises(RuntimeConfigError, match="cut_causal_lm records"):
        save_pretrained_folder({"library": "timm"}, {}, tmp_path)
    with pytest.raises(RuntimeConfigError, match="no model class 'NoSuchModel'"):
        save_pretrained_folder(
            {"library": "transformers", "class": "NoSuchModel", "config": {}}, {}, tmp_path
        )


# -- end to end: tied weights, Llama-style, meta, export ------------------------------------
def windows(count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sequences = [ids(batch=4, length=13, seed=s) for s in range(count)]
    return [(s[:, :-1], s[:, 1:]) for s in sequences]


def single_process(model: Any, steps: int, micro: int) -> list[float]:
    """The model's own training: gradients accumulated over micro-batches, one AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in windows(steps):
        total = 0.0
        for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro), strict=True):
            loss = causal_lm_loss(model(xs).logits, ys) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize(("name", "method"), [("gpt2-tied", "zb-h1"), ("llama-tied", "1f1b")])
def test_tied_decoder_trains_as_the_model_itself_would_and_exports(
    name: str, method: str, tmp_path: Path
) -> None:
    steps = 3

    def build() -> Any:
        torch.manual_seed(0)
        return gpt2(tied=True, dropout=0.0) if name.startswith("gpt2") else MODELS[name]()

    reference = build()
    expected = single_process(reference, steps, 2)
    model = build()
    cut = cut_causal_lm(model)
    pipe = Pipeline(
        cut,
        method=method,
        stages=2,
        micro_batches=2,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    result = pipe.fit(windows(steps), max_steps=steps)
    assert result.losses == pytest.approx(expected, abs=1e-5)
    assert len(pipe.parts.ties) == 1  # the embedding on stage 0 is the head on stage 1
    folder = pipe.export(tmp_path / "hf", fmt="hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    x = ids(batch=2, length=12, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, reference.eval()(x).logits, atol=1e-5, rtol=0)
    # the same from the checkpoint folder, by the command
    from pipeoptim.cli import main

    out = tmp_path / "cli"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out),
                 "--format", "hf"]) == 0  # fmt: skip
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, loaded(x).logits)


@pytest.mark.parametrize(("name", "method"), [("llama", "pipeoptim"), ("qwen2", "zb-h1")])
def test_llama_style_trains_under_pipeoptim_and_zb_h1(name: str, method: str) -> None:
    model = MODELS[name]()
    cut = cut_causal_lm(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sizes = {"micro_batches": 4} if method != "pipeoptim" else {}
    pipe = Pipeline(
        cut, method=method, stages=3, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), **sizes
    )
    result = pipe.fit(windows(4), max_steps=4)
    assert all(math.isfinite(loss) for loss in result.losses)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == sorted(before)


def test_tied_decoder_under_pipeoptim_is_refused_with_the_fix() -> None:
    cut = cut_causal_lm(gpt2(tied=True))
    with pytest.raises(RuntimeConfigError, match="tie_word_embeddings=False"):
        Pipeline(cut, method="pipeoptim", stages=2)


def test_decoder_built_on_meta_trains_from_its_own_init() -> None:
    with torch.device("meta"):
        model = gpt2(tied=True, dropout=0.0)
    cut = cut_causal_lm(model)
    pipe = Pipeline(cut, method="gpipe", stages=2, micro_batches=2,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))  # fmt: skip
    assert not any(p.is_meta for s in pipe.stages.values() for p in s.module.parameters())
    last = pipe.stages[1].module
    head = last.get_parameter(f"{len(last) - 1}.lm_head.weight")
    assert torch.equal(pipe.stages[0].module.get_parameter("0.wte.weight"), head)
    result = pipe.fit(windows(3), max_steps=3)
    assert math.log(VOCAB) - 0.5 < result.losses[0] < math.log(VOCAB) + 0.5  # a fresh init


@pytest.mark.slow
def test_tied_gpt2_on_meta_under_torchrun_equals_one_process_and_exports(tmp_path: Path) -> None:
    """Two gloo ranks, each materialising only its own stage of a meta-built tied GPT-2 (the
    dry run stage by stage, the embedding's copies exchanged), train and export exactly what
    one process does."""
    import json
    import socket

    worker = FOLDER / "hf_dist_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]  # fmt: skip
    for where, command in [("dist", launcher), ("local", [sys.executable])]:
        extra = [] if where == "dist" else ["--transport", "local"]
        done = subprocess.run(
            [*command, str(worker), "--out", str(tmp_path / where), *extra],
            capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads((tmp_path / w / "losses.json").read_text()) for w in ("dist", "local")]
    assert losses[0] == losses[1]
    x = ids(batch=2, length=12, seed=4)
    loaded = [
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / w / "hf").eval()
        for w in ("dist", "local")
    ]
    with torch.no_grad():
        assert torch.equal(loaded[0](x).logits, loaded[1](x).logits)
