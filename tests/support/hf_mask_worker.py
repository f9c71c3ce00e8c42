"""One rank of the padded-batch test under torchrun (tests/hf/test_padding_masks.py): a cut
Llama trained on dict batches (ids and a padding mask, left and right padded, labels -100
on padding) over 2 gloo ranks with one tag (the agreed posting order); ``--transport local``
runs the same in one process. Writes the losses and a digest of the trained weights."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from pipeoptim import Pipeline
from pipeoptim.hf import IGNORE_INDEX, cut_causal_lm

Batches = list[tuple[dict[str, torch.Tensor], torch.Tensor]]


def padded_batches(lengths: Sequence[int], batch: int) -> Batches:
    """One batch per entry of ``lengths`` (its tokens), each row padded on the left (even
    rows) or the right (odd rows) by a seeded amount; labels are the next token, -100 on
    padding."""
    g = torch.Generator().manual_seed(3)
    out = []
    for length in lengths:
        ids = torch.randint(1, 101, (batch, length + 1), generator=g)
        mask = torch.ones(batch, length + 1, dtype=torch.long)
        for row in range(batch):
            pad = int(torch.randint(1, length // 2, (1,), generator=g))
            if row % 2 == 0:
                mask[row, :pad] = 0
            else:
                mask[row, length + 1 - pad :] = 0
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
        out.append(({"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1]}, labels))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", default="dist")
    parser.add_argument("--method", default="1f1b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    sizes = {"micro_batches": 2} if args.method != "pipeoptim" else {}
    pipe = Pipeline(
        cut_causal_lm(model),
        method=args.method,
        stages=2,
        transport=args.transport,
        one_tag=args.transport == "dist",
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        device="cpu",
        timeout=60,
        **sizes,
    )
    result = pipe.fit(padded_batches([10] * 4, 4), max_steps=4)
    if 0 in pipe.stages:
        (args.out / "losses.json").write_text(json.dumps(result.losses))
    pipe.close()


if __name__ == "__main__":
    main()
