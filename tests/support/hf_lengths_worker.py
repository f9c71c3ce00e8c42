"""One rank of the dynamic-padding test under torchrun (tests/hf/test_padded_lengths.py):
a cut Llama trained on dict batches whose length changes from batch to batch (each padded
to its own longest sequence, left or right, labels -100 on padding), with varying shapes on,
over 2 gloo ranks with one tag; ``--transport local`` runs the same in one process. For
each method named, writes the losses."""

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

try:
    from support import hf_mask_worker as mask_worker
except ImportError:  # run as torchrun's script: this folder is the first on the path
    import hf_mask_worker as mask_worker  # type: ignore[no-redef]

Batches = mask_worker.Batches
LENGTHS = (9, 6, 12, 7, 10)
"""Each batch's longest sequence: the tensors crossing the boundary change shape."""


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def padded_batches(batch: int = 4) -> Batches:
    """One batch per entry of :data:`LENGTHS`, rows padded on the left or the right."""
    return mask_worker.padded_batches(LENGTHS, batch)


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def train(method: str, transport: str) -> list[float] | None:
    """The losses of ``method`` on the padded batches (None on a rank without them)."""
    pipe = Pipeline(
        cut_causal_lm(llama()),
        method=method,
        stages=2,
        micro_batches=None if method == "pipeoptim" else 2,
        transport=transport,
        one_tag=transport == "dist",
        varying_shapes=True,
        optimizer=adamw,
        device="cpu",
        timeout=120,
    )
    result = pipe.fit(padded_batches(), max_steps=len(LENGTHS))
    losses = list(result.losses) if 0 in pipe.stages else None
    pipe.close()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", default="dist")
    parser.add_argument("--methods", default="1f1b,zb-h1,pipeoptim,xpipe")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    record = {m: train(m, args.transport) for m in args.methods.split(",")}
    if all(losses is not None for losses in record.values()):
        (args.out / "losses.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
