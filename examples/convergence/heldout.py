"""The 8-stage result checked on a language model and corpus the study never trained: a
Hugging Face Llama (RMSNorm, rotary positions, SwiGLU; built from a config, nothing
downloaded) on English prose, the text of Python's documentation topics
(``pydoc_data.topics``, in the standard library), with the study's recipe.

    python examples/convergence/heldout.py              # 13 runs of 2,000 updates, two at a
                                                        # time: ~50 minutes on 2 cores
    python examples/convergence/heldout.py --report-only

Rows: gpipe and pipeoptim under AdamW, gpipe and pipeoptim+nesterov under Muon, gpipe and
pipeoptim under Basis Rotation (Adam in each matrix's gradient eigenbasis); the one-step
family (xpipe under AdamW and Muon, with and without the extrapolation at λ = 0.5,
2bw+extrapolate under Muon, xpipe and 2bw under Basis Rotation; M = 8 micro-batches), 8 stages
(9 units: the embedding, 7 decoder layers, the final norm with the head), 2,000 updates of
32 windows of 64 characters, AdamW's recipe of the study (2e-3, weight decay 0.01, 10 %
warm-up, cosine to 0.1x, clipping 1.0 per stage; Muon and Basis Rotation at the same rate
and schedule).
Nothing here is tuned: the model's sizes are the study's (width 64, 4 heads). Results go
to ``results/heldout/runs.jsonl`` and ``results/heldout/README.md``.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

from ablate import script_main  # the script beside this one

RESULTS = Path(__file__).resolve().parent / "results" / "heldout"
STAGES, STEPS, BATCH, LR, CONTEXT = 8, 2000, 32, 2e-3, 64
RUNS = {
    # name: (method, optimizer)
    "gpipe": ("gpipe", "adamw"),
    "pipeoptim": ("pipeoptim", "adamw"),
    "gpipe (muon)": ("gpipe", "muon"),
    "pipeoptim+nesterov (muon)": ("pipeoptim+nesterov", "muon"),
    "gpipe (basis-rotation)": ("gpipe", "basis-rotation"),
    "pipeoptim (basis-rotation)": ("pipeoptim", "basis-rotation"),
    # the one-step family and its extrapolation (issue 65), under both optimizers
    "xpipe": ("xpipe", "adamw"),
    "xpipe+extrapolate λ=0.5": ("xpipe+extrapolate", "adamw"),
    "xpipe (muon)": ("xpipe", "muon"),
    "xpipe+extrapolate λ=0.5 (muon)": ("xpipe+extrapolate", "muon"),
    "2bw+extrapolate λ=0.5 (muon)": ("2bw+extrapolate", "muon"),
    # the one-step family under Basis Rotation, the study's closest one-step rows
    "xpipe (basis-rotation)": ("xpipe", "basis-rotation"),
    "2bw (basis-rotation)": ("2bw", "basis-rotation"),
}

OPTIONS: dict[str, dict[str, object]] = {
    name: {"extrapolation": 0.5} for name in RUNS if "+extrapolate λ=0.5" in name
}
"""Pipeline keywords of the rows that need more than their method and optimizer."""


def corpus() -> tuple[object, object, object, object]:
    """Windows of 65 characters of the documentation topics, in sorted order of their
    names; every 5th topic is a test topic (the split is by topic)."""
    import pydoc_data.topics

    from pipeoptim.workloads.gpt import _windows, encode

    names = sorted(pydoc_data.topics.topics)
    train = "".join(pydoc_data.topics.topics[n] for i, n in enumerate(names) if i % 5 != 4)
    test = "".join(pydoc_data.topics.topics[n] for i, n in enumerate(names) if i % 5 == 4)
    return (*_windows(encode(train), CONTEXT), *_windows(encode(test), CONTEXT))


def run(name: str) -> dict[str, object]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeoptim import Pipeline
    from pipeoptim.hf import cut_causal_lm
    from pipeoptim.plan.methods import get_method
    from pipeoptim.plan.plan import OptimizerSpec
    from pipeoptim.runtime.optim.lr import WarmupCosine
    from pipeoptim.workloads.data import DatasetLoader
    from pipeoptim.workloads.gpt import VOCAB_SIZE

    method, optimizer = RUNS[name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,  # asynchronous methods refuse a weight on two stages
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    train_x, train_y, test_x, test_y = corpus()
    pipe = Pipeline(
        cut_causal_lm(LlamaForCausalLM(config)),
        method=method,
        stages=STAGES,
        micro_batches=STAGES if get_method(method).micro_batched_by_default else 1,
        optimizer=OptimizerSpec(optimizer, LR, {"weight_decay": 0.01}),
        scheduler=functools.partial(LambdaLR, lr_lambda=WarmupCosine(200, STEPS, 0.1)),
        grad_clip=1.0,
        seed=0,
        progress=False,
        log_every=10**9,
        **OPTIONS.get(name, {}),  # type: ignore[arg-type]
    )
    train = DatasetLoader(train_x, train_y, BATCH, seed=0)  # type: ignore[arg-type]
    test = DatasetLoader(test_x[:1024], test_y[:1024], 256, shuffle=False)  # type: ignore[index]
    start = time.perf_counter()
    result = pipe.fit(train, max_steps=STEPS, eval_data=test, eval_every=500)
    curve = [(ev.step, ev.loss) for ev in result.eval_history]
    return {"name": name, "curve": curve, "seconds": time.perf_counter() - start}


def report(records: list[dict[str, object]]) -> str:
    by = {str(r["name"]): r for r in records}

    def final(name: str) -> float:
        return float(by[name]["curve"][-1][1]) if name in by else math.nan  # type: ignore[index]

    lines = [
        "# Held-out LM check",
        "",
        "Final test loss (first 1,024 test windows) and its excess over gpipe's under AdamW "
        "and over gpipe's under the row's own optimizer; 8 stages, one seed.",
        "",
        "| row | test loss | over gpipe (AdamW) | over gpipe, same optimizer | minutes |",
        "|---|---|---|---|---|",
    ]
    for name in RUNS:
        if name not in by:
            continue
        optimizer = RUNS[name][1]
        own = "gpipe" if optimizer == "adamw" else f"gpipe ({optimizer})"
        lines.append(
            f"| {name} | {final(name):.3f} | {100 * (final(name) / final('gpipe') - 1):+.1f} % "
            f"| {100 * (final(name) / final(own) - 1):+.1f} % "
            f"| {float(by[name]['seconds']) / 60:.1f} |"  # type: ignore[arg-type]
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    script_main(__doc__, list(RUNS), run, RESULTS / "runs.jsonl", report, RESULTS / "README.md")


if __name__ == "__main__":
    main()
