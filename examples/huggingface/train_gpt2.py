"""Train a Hugging Face GPT-2 through a pipeline: built from a config, cut by pipeoptim.hf.

    python examples/huggingface/train_gpt2.py                        # tied, zb-h1, 2 stages
    python examples/huggingface/train_gpt2.py --untied --method pipeoptim
    python examples/huggingface/train_gpt2.py --meta --export gpt2-trained

A small ``GPT2LMHeadModel`` (nothing downloaded) learns next-character prediction on the
Python standard library's own source (pipeoptim's built-in corpus, offline). The model is
cut into units (embeddings, one per block, final norm and head), the units train in a
``Pipeline`` in this one process. GPT-2 ties its output projection to its input embedding
(the default here): a synchronous method keeps that one weight across the two stages; an
asynchronous one (pipeoptim) refuses it, so ``--untied`` goes with those. ``--meta`` builds the
model on the meta device (no storage) and lets each stage materialise its own units;
``--export`` writes the trained model as a folder ``from_pretrained`` loads, and checks it.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model from a config needs no network

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from pipeoptim import Pipeline
from pipeoptim.hf import cut_causal_lm
from pipeoptim.workloads.data import DatasetLoader
from pipeoptim.workloads.gpt import VOCAB_SIZE, python_corpus

CONTEXT = 64
"""Characters per training window, and the model's number of positions."""


def make_model(tied: bool) -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the same initial weights on every run
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,  # the corpus's character ids
        n_positions=CONTEXT,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,  # GPT-2's default ids are past this small vocabulary
        eos_token_id=0,
        tie_word_embeddings=tied,
    )
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="zb-h1")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, help="for micro-batching methods")
    parser.add_argument("--lr", type=float, default=2e-3)
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument(
        "--tied", dest="tied", action="store_true", help="tie lm_head to wte (default)"
    )
    tie.add_argument("--untied", dest="tied", action="store_false", help="for asynchronous methods")
    parser.set_defaults(tied=True)
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device")
    parser.add_argument("--export", metavar="DIR", help="write a from_pretrained folder here")
    args = parser.parse_args()

    corpus = python_corpus(context=CONTEXT, train_chars=300_000, test_chars=10_000)
    data = DatasetLoader(corpus.train_x, corpus.train_y, args.batch_size, seed=0)
    if args.meta:
        with torch.device("meta"):
            model = make_model(args.tied)
    else:
        model = make_model(args.tied)
    cut = cut_causal_lm(model)
    print(
        f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters "
        f"in {len(cut.units)} units, {args.method} on {args.stages} stages"
    )
    pipe = Pipeline(
        cut,  # the units, their names in the model, the loss and the meta initialiser
        method=args.method,
        stages=args.stages,
        micro_batches=args.micro_batches,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        progress=True,
    )
    start = time.perf_counter()
    result = pipe.fit(data, max_steps=args.steps)
    elapsed = time.perf_counter() - start
    every = max(1, len(result.losses) // 6)
    for step in range(0, len(result.losses), every):
        print(f"step {step:4d}  loss {result.losses[step]:.3f}")
    print(
        f"first loss {result.losses[0]:.3f}, last loss {result.losses[-1]:.3f} "
        f"({len(result.losses)} steps in {elapsed:.1f} s)"
    )
    if args.export:
        folder = pipe.export(args.export, fmt="hf")
        loaded = GPT2LMHeadModel.from_pretrained(folder).eval()
        ids = corpus.test_x[:4]
        with torch.no_grad():
            h = ids
            for stage in sorted(pipe.stages):
                h = pipe.stages[stage].forward_eval(h)
            same = torch.allclose(loaded(ids).logits, h, atol=1e-5)
        print(f"exported to {folder}; from_pretrained gives the pipeline's logits: {same}")


if __name__ == "__main__":
    main()
