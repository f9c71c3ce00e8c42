"""Hugging Face models on the meta device, exported and cut: a Llama built on the meta device and
loaded from a state dict gives ``from_pretrained``'s logits (its rotary buffers are in no state
dict); an hf export onto an existing file is refused; cutting a model leaves its config as it
was, so a second cut records the user's setting."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: no network

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipeoptim import Pipeline  # noqa: E402
from pipeoptim.errors import PipeoptimError  # noqa: E402
from pipeoptim.hf import cut_causal_lm  # noqa: E402

VOCAB = 101
ROTARY = {
    "vocab_size": VOCAB,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**ROTARY))


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))


def test_a_meta_llama_loaded_from_a_state_dict_gives_from_pretrained_logits(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    trained = llama().eval()
    trained.save_pretrained(tmp_path / "saved")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    state = reference.state_dict()
    with torch.device("meta"):
        meta_model = llama()
    cut = cut_causal_lm(meta_model)

    def load(index: int, unit: nn.Module) -> None:  # the README's loader: the unit's part
        names = cut.unit_names(index)
        unit.load_state_dict({key: state[names[key][0]] for key in unit.state_dict()})

    pipe = Pipeline(cut, method="gpipe", stages=2, device="cpu", init_weights=load)
    x = ids()
    with torch.no_grad():
        h = x
        for k in sorted(pipe.stages):
            pipe.stages[k].module.eval()
            h = pipe.stages[k].module(h)
        torch.testing.assert_close(h, reference(x).logits, rtol=0, atol=0)


def test_an_hf_export_onto_an_existing_file_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    pipe = Pipeline(cut_causal_lm(llama()), method="gpipe", stages=2, device="cpu")
    target = tmp_path / "model"
    target.write_text("")
    with pytest.raises(PipeoptimError, match=r"is a file.*hf format writes a folder"):
        pipe.export(target, fmt="hf")
    assert target.read_text() == ""
    folder = pipe.export(tmp_path / "folder", fmt="hf")  # a folder is written, and says so
    assert (folder / "config.json").is_file()


def test_cutting_leaves_the_users_config_as_it_was() -> None:
    model = llama()
    assert model.config.use_cache is True
    first = cut_causal_lm(model)
    assert model.config.use_cache is True  # the user's model still generates with its cache
    second = cut_causal_lm(model)
    assert first.source["config"]["use_cache"] is True
    assert second.source["config"]["use_cache"] is True
    x = ids()
    with torch.no_grad():
        h = x
        for unit in second.units:
            h = unit(h)
        torch.testing.assert_close(h, model(x).logits, rtol=0, atol=0)
