"""One rank of the Hugging Face test under torchrun (test_cut.py): a tied GPT-2 built on the
meta device, cut, trained with zb-h1 over 2 gloo ranks (each materialises its own stage), and
exported as a ``from_pretrained`` folder; ``--transport local`` runs the same in one process."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from pipeoptim import Pipeline
from pipeoptim.hf import cut_causal_lm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", default="dist")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = transformers.GPT2Config(
        vocab_size=101, n_layer=2, n_embd=32, n_head=2, n_positions=32,
        tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 101, (4, 8, 13), generator=torch.Generator().manual_seed(1))
    pipe = Pipeline(
        cut_causal_lm(model),
        method="zb-h1",
        stages=2,
        micro_batches=2,
        transport=args.transport,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        device="cpu",
        checkpoint_dir=str(args.out / "ckpt"),
        timeout=60,
    )
    result = pipe.fit([(s[:, :-1], s[:, 1:]) for s in ids], max_steps=4)
    pipe.export(args.out / "hf", fmt="hf")
    if 0 in pipe.stages:
        (args.out / "losses.json").write_text(json.dumps(result.losses))
    pipe.close()


if __name__ == "__main__":
    main()
