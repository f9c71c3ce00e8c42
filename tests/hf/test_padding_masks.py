"""``pipeoptim.hf``: a padded batch (a dict of ids and attention mask) through a cut model
gives, on its non-padding positions, the logits of the uncut model called with the same
mask, for left and right padding alike; the mask crosses stage boundaries and trains under
1f1b and pipeoptim, in one process and over 2 gloo ranks with one tag, bitwise alike."""

from __future__ import annotations

import json
import math
import os
import socket
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

from pipeoptim import Pipeline  # noqa: E402
from pipeoptim.errors import RuntimeConfigError  # noqa: E402
from pipeoptim.hf import IGNORE_INDEX, causal_lm_loss, cut_causal_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 101
SMALL = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
TOLERANCE = 1e-5  # float32 logits of two orders of the same sums


def llama() -> Any:
    config = transformers.LlamaConfig(
        **SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2() -> Any:
    config = transformers.GPT2Config(
        **SMALL, n_layer=2, n_embd=32, n_head=2, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


MODELS: dict[str, Callable[[], Any]] = {"llama": llama, "gpt2": gpt2}


def padded(side: str, batch: int = 4, length: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Ids and a mask whose rows hold 0 to batch - 1 padding tokens on ``side``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        pad = 3 * row
        if pad:
            mask[row, :pad] = 0 if side == "left" else 1
            if side == "right":
                mask[row, length - pad :] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_padded_batch_gives_the_uncut_models_logits(name: str, side: str) -> None:
    model = MODELS[name]().eval()
    cut = cut_causal_lm(model)
    batch = padded(side)
    with torch.no_grad():
        own = model(**batch).logits
        h: Any = batch
        for unit in cut.units:
            h = unit(h)
        unmasked: Any = batch["input_ids"]
        for unit in cut.units:
            unmasked = unit(unmasked)
    real = batch["attention_mask"].bool()
    assert torch.isfinite(h).all()
    torch.testing.assert_close(h[real], own[real], rtol=TOLERANCE, atol=TOLERANCE)
    if side == "left":  # without the mask its rows attend to their padding (right: causal)
        assert (unmasked[real] - own[real]).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_position_ids_of_the_batch_are_the_models(name: str) -> None:
    model = MODELS[name]().eval()
    cut = cut_causal_lm(model)
    batch = padded("left")
    positions = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        own = model(**batch, position_ids=positions).logits
        h: Any = {**batch, "position_ids": positions}
        for unit in cut.units:
            h = unit(h)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(h[real], own[real], rtol=TOLERANCE, atol=TOLERANCE)


def test_a_batch_dict_with_other_keys_is_refused_naming_them() -> None:
    cut = cut_causal_lm(llama())
    batch = {**padded("left"), "labels": torch.zeros(4, 12, dtype=torch.long)}
    with pytest.raises(RuntimeConfigError, match=r"\['labels'\] unknown.*keep the labels out"):
        cut.units[0](batch)


def _batches(side: str) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    out = []
    for seed in range(3):
        full = padded(side, length=13, seed=seed)
        ids, mask = full["input_ids"], full["attention_mask"]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
        out.append(({"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1]}, labels))
    return out


@pytest.mark.parametrize("method", ["1f1b", "pipeoptim"])
def test_cut_llama_trains_on_padded_batches(method: str) -> None:
    """The first loss is the uncut model's on the same batch (its token mean, whatever
    the micro-batches); every weight trains."""
    model = llama()
    cut = cut_causal_lm(model)
    batches = _batches("left")
    micro = 2 if method != "pipeoptim" else 1
    x, y = batches[0]
    with torch.no_grad():
        logits = model(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
        own = causal_lm_loss(logits, y).item()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sizes = {"micro_batches": micro} if method != "pipeoptim" else {}
    pipe = Pipeline(
        cut.units,
        method=method,
        stages=2,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        loss_fn=cut.loss_fn,
        **sizes,
    )
    result = pipe.fit(batches, max_steps=3)
    assert all(math.isfinite(loss) for loss in result.losses)
    assert result.losses[0] == pytest.approx(own, rel=TOLERANCE)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == sorted(k for k in before if "rotary" not in k)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["1f1b", "pipeoptim"])
def test_padded_batches_over_two_gloo_ranks_with_one_tag_equal_one_process(
    method: str, tmp_path: Path
) -> None:
    """The mask travels as a part of the dict message in the agreed posting order."""
    worker = FOLDER / "hf_mask_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]  # fmt: skip
    for where, command in [("dist", launcher), ("local", [sys.executable])]:
        extra = [] if where == "dist" else ["--transport", "local"]
        done = subprocess.run(
            [*command, str(worker), "--method", method, "--out", str(tmp_path / where), *extra],
            capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads((tmp_path / w / "losses.json").read_text()) for w in ("dist", "local")]
    assert len(losses[0]) == 4
    assert all(math.isfinite(loss) for loss in losses[0])
    assert losses[0] == losses[1]
