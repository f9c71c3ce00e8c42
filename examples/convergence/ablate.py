"""Where the asynchronous language model loses its loss: PipeDream's delays on gpt-deep at 8
stages, kept or removed by stage, by kind of weight and by phase of training.

    python examples/convergence/ablate.py              # every run (11 x 2,000 updates, one
                                                       # process each: 80-130 s on a core)
    python examples/convergence/ablate.py --report-only

Each run is the study's recipe (AdamW 2e-3, weight decay 0.01, 10 % warm-up, cosine to
0.1x, clipping 1.0 per stage, 2,000 mini-batches of 32, a drain every 250) trained by
:class:`pipeoptim.study.delays.DelayEmulator`, which gives the pipedream pipeline's weights
(``tests/study/test_delays.py``) with the delay of every parameter chosen apart. Results go
to ``results/gpt-deep/ablation.jsonl`` (resumable) and ``results/gpt-deep/ablation.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "gpt-deep"
STAGES, STEPS, EVAL_EVERY, BATCH, LR = 8, 2000, 250, 32, 2e-3
ATTENTION = ("norm1", "qkv", "proj")
MLP = ("norm2", "up", "down")


def _kind(name: str) -> str:
    leaf = name.split(".")[-2] if "." in name else name
    if leaf in ATTENTION:
        return "attention"
    if leaf in MLP:
        return "mlp"
    return "ends"  # embedding, final norm, head


ABLATIONS: dict[str, tuple[str, Callable[[str, int, int, int], bool]]] = {
    # name: (what it keeps delayed, keep(name, stage, step, τ) -> delayed?)
    "none": ("no delay anywhere (synchronous)", lambda n, k, t, tau: False),
    "all": ("every stage's own delay (pipedream)", lambda n, k, t, tau: True),
    "stage 0 only": ("only stage 0 (τ=7)", lambda n, k, t, tau: k == 0),
    # the embedding (stage 0, τ=7); the final norm and head sit on the last stage (τ=0)
    "ends": ("only the embedding", lambda n, k, t, tau: _kind(n) == "ends"),
    "attention": ("only attention weights", lambda n, k, t, tau: _kind(n) == "attention"),
    "mlp": ("only MLP weights", lambda n, k, t, tau: _kind(n) == "mlp"),
    "early": ("every stage, first 500 updates", lambda n, k, t, tau: t < 500),
    "late": ("every stage, after 500 updates", lambda n, k, t, tau: t >= 500),
}

SCREENS: dict[str, tuple[str, Callable[[int], tuple[float, float]]]] = {
    # Corrections screened under pipedream's delays, each a rule of the stage's τ alone:
    # name: (what, tau -> (lr factor, β1))
    "lr/(1+τ)": ("every stage's rate divided by 1+τ", lambda tau: (1 / (1 + tau), 0.9)),
    "lr/√(1+τ)": ("every stage's rate divided by √(1+τ)", lambda tau: ((1 + tau) ** -0.5, 0.9)),
    "β1=0.9^(1+τ)": ("momentum 0.9^(1+τ): less at depth", lambda tau: (1.0, 0.9 ** (1 + tau))),
}


def run(name: str) -> dict[str, object]:
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from pipeoptim.plan.plan import even_boundaries
    from pipeoptim.runtime.optim.lr import WarmupCosine
    from pipeoptim.study.delays import DelayEmulator
    from pipeoptim.workloads.data import DatasetLoader
    from pipeoptim.workloads.gpt import gpt_deep, lm_loss, python_corpus_deep

    torch.set_num_threads(1)
    torch.manual_seed(0)
    units = gpt_deep()
    data = python_corpus_deep()
    keep = ABLATIONS[name][1] if name in ABLATIONS else (lambda n, k, t, tau: True)
    tune = SCREENS[name][1] if name in SCREENS else (lambda tau: (1.0, 0.9))
    bounds = even_boundaries(len(units), STAGES)
    stage_of = {
        id(p): k for k, (a, b) in enumerate(bounds) for u in units[a:b] for p in u.parameters()
    }

    def delay(param: str, stage: int, step: int) -> int:
        tau = STAGES - 1 - stage
        return tau if keep(param, stage, step, tau) else 0

    def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        factor, beta1 = tune(STAGES - 1 - stage_of[id(params[0])])
        return torch.optim.AdamW(params, lr=LR * factor, betas=(beta1, 0.999), weight_decay=0.01)

    emulator = DelayEmulator(
        units,
        bounds,
        optimizer=optimizer,
        loss_fn=lm_loss,
        delay=delay,
        max_delay=STAGES - 1,
        scheduler=functools.partial(LambdaLR, lr_lambda=WarmupCosine(200, STEPS, 0.1)),
        grad_clip=1.0,
        drain_every=EVAL_EVERY,
    )
    train = DatasetLoader(data.train_x, data.train_y, BATCH, seed=0)
    test_x, test_y = data.test_x[:1024], data.test_y[:1024]
    start, curve, losses = time.perf_counter(), [], []
    batches = iter(())  # type: ignore[var-annotated]
    while emulator.steps < STEPS:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(train)
            continue
        losses.append(emulator.step(x, y))
        if emulator.steps % EVAL_EVERY == 0:
            emulator.model.eval()
            with torch.no_grad():
                test = float(lm_loss(emulator.model(test_x), test_y))
            emulator.model.train()
            curve.append((emulator.steps, test))
    return {
        "name": name,
        "what": (ABLATIONS.get(name) or SCREENS[name])[0],
        "curve": curve,
        "train_loss": math.fsum(losses[-EVAL_EVERY:]) / EVAL_EVERY,
        "seconds": time.perf_counter() - start,
    }


def report(records: list[dict[str, object]]) -> str:
    by = {str(r["name"]): r for r in records}
    sync = by.get("none")
    full = by.get("all")
    base = float(sync["curve"][-1][1]) if sync else math.nan  # type: ignore[index]
    gap = float(full["curve"][-1][1]) - base if full else math.nan  # type: ignore[index]
    lines = [
        "| delayed | test loss | over synchronous | share of pipedream's gap |",
        "|---|---|---|---|",
    ]
    for names, title in ((ABLATIONS, None), (SCREENS, "correction (all stages delayed)")):
        if title is not None:
            lines += ["", f"| {title} | test loss | over synchronous | share of pipedream's gap |"]
            lines.append("|---|---|---|---|")
        for name in names:
            r = by.get(name)
            if r is None:
                continue
            loss = float(r["curve"][-1][1])  # type: ignore[index]
            share = (loss - base) / gap if gap and math.isfinite(gap) else math.nan
            lines.append(f"| {r['what']} | {loss:.3f} | {loss - base:+.3f} | {share:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    script_main(
        __doc__,
        [*ABLATIONS, *SCREENS],
        run,
        RESULTS / "ablation.jsonl",
        report,
        RESULTS / "ablation.md",
    )


def script_main(
    doc: str | None,
    names: list[str],
    run: Callable[[str], dict[str, object]],
    runs_path: Path,
    report: Callable[[list[dict[str, object]]], str],
    report_path: Path,
) -> None:
    """The command line of a script of named runs: ``--workers``, ``--report-only`` and
    ``--only``; runs what is missing (:func:`run_resumable`), writes the report."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated names to run")
    args = parser.parse_args()
    chosen = names if args.only is None else args.only.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"--only names no run of this script: {unknown}; choose from {names}")
    done = run_resumable(chosen, run, runs_path, args.workers, run_again=not args.report_only)
    text = report(done)
    report_path.write_text(text)
    print(text)


def run_resumable(
    names: list[str],
    run: Callable[[str], dict[str, object]],
    path: Path,
    workers: int,
    *,
    run_again: bool = True,
) -> list[dict[str, object]]:
    """The records of ``path`` (one JSON line per finished run, keyed by ``name``), after
    running, in ``workers`` processes, the names not yet there; each record is appended as
    soon as its run finishes, so an interrupted script resumes with what finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    todo = [n for n in names if n not in {d["name"] for d in done}]
    if run_again and todo:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            for future in as_completed([pool.submit(run, n) for n in todo]):
                record = future.result()
                done.append(record)
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"{record['name']}: {record['seconds']:.0f} s", flush=True)
    return done


if __name__ == "__main__":
    main()
