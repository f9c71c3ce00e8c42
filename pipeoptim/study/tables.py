"""The study's markdown tables: final metric and loss, prediction closure, time to target.

Each function returns the table's lines; :func:`pipeoptim.study.report.write_study_report`
puts them under their headings. Numbers are formatted here only (accuracy in %, perplexity
and loss to a few digits, ``—`` where nothing finite was measured).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.risk import WITHIN
from pipeoptim.study.cells import (
    Cell,
    higher_is_better,
    method_labels,
    row_micro_batches,
    schedule_of,
    synchronous_label,
)
from pipeoptim.study.equal_time import EqualTimeResult
from pipeoptim.study.grid import StudyConfig
from pipeoptim.study.runs import RunRecord
from pipeoptim.study.targets import Target, Targets, TimeToTarget

__all__ = [
    "closure_by_micro_batches_table",
    "closure_rows",
    "closure_table",
    "equal_time_table",
    "final_table",
    "gap_table",
    "peak_copies",
    "time_ratio_table",
    "time_table",
]


def _fmt_metric(model: str, mean: float, std: float) -> str:
    """``97.1 ± 0.4`` (accuracy in %) or ``9.87 ± 0.12``; no ± for a single seed."""
    if not math.isfinite(mean):
        return "—"
    scale, digits = (100, 1) if higher_is_better(model) else (1, 2)
    spread = f" ± {scale * std:.{digits}f}" if math.isfinite(std) else ""
    return f"{scale * mean:.{digits}f}{spread}"


def _fmt_loss(mean: float, std: float) -> str:
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.3g}" + (f" ± {std:.2g}" if math.isfinite(std) else "")


def _final_metric(r: RunRecord) -> float:
    return r.final.test_metric if r.final else math.nan


def _final_loss(r: RunRecord) -> float:
    return r.final.train_loss if r.final else math.nan


def final_table(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    lr_of: dict[str, float],
) -> list[str]:
    """Markdown rows: one per method, a column per (optimizer, depth)."""
    metric = "test accuracy %" if higher_is_better(config.model) else "test perplexity"
    columns = [
        (opt, lr_of[opt], p) for opt in config.optimizers if opt in lr_of for p in config.stages
    ]
    if not columns:
        return []
    head = "| method | " + " | ".join(f"{o} lr={lr:g} P={p}" for o, lr, p in columns) + " |"
    lines = [
        f"{metric} / final training loss (mean ± std over seeds; ✗k: k seeds diverged)",
        "",
        head,
        "|---|" + "---|" * len(columns),
    ]
    for method in method_labels(config):
        row = []
        for opt, lr, p in columns:
            assert lr is not None
            cell = cells.get((method, opt, lr, p))
            if cell is None:
                row.append("not run")
                continue
            text = (
                f"{_fmt_metric(config.model, *cell.stat(_final_metric))} / "
                f"{_fmt_loss(*cell.stat(_final_loss))}"
            )
            if cell.diverged:
                text += f" ✗{cell.diverged}"
            row.append(text)
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return lines


def peak_copies(label: str, stages: int) -> int:
    """Weight copies the row's method keeps on its fullest stage (stage 0): the memory
    model's count (``plan.memory_factors``); the predicted-backward variant keeps one Ŵ per
    mini-batch in flight, as a stash does."""
    method = get_method(schedule_of(label))
    m = row_micro_batches(label, stages)
    if "Ŵbackward" in label:
        return stages  # current weights and a Ŵ per mini-batch in flight (P−1 at stage 0)
    factors = method_memory_factors(method.name, stages, m)
    return max(factors(k, stages)[0] for k in range(stages))


def gaps(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    *,
    same_optimizer: bool = True,
) -> dict[int, dict[str, float]]:
    """Stages -> row -> final test loss over gpipe's at that depth, minus 1 (the rows that
    finished; the first optimizer's chosen rate). The yardstick is gpipe under the row's own
    optimizer (``gpipe (muon)`` for a Muon row; a row whose optimizer has no gpipe at that
    depth has no gap), or with ``same_optimizer=False`` gpipe under the first optimizer."""
    opt = config.optimizers[0]
    lr = rates[opt][0]
    out: dict[int, dict[str, float]] = {}
    for p in config.stages:
        for label in method_labels(config):
            cell = cells.get((label, opt, lr, p))
            base = cells.get((synchronous_label(label) if same_optimizer else "gpipe", opt, lr, p))
            if cell is None or base is None:
                continue
            loss, ref = cell.final_test_loss, base.final_test_loss
            if math.isfinite(loss) and math.isfinite(ref):
                out.setdefault(p, {})[label] = loss / ref - 1.0
    return out


def gap_table(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
) -> list[str]:
    """Markdown: each row's final test loss against gpipe's under the same optimizer at the
    same depth (the goal: within 3 %, ✓), beside it for a row of another optimizer its
    excess over gpipe under the first, and the weight copies it keeps on its fullest
    stage."""
    opt = config.optimizers[0]
    lr = rates[opt][0]
    lines = [
        f"Final test loss (mean over seeds) and its excess over gpipe's **under the same "
        f"optimizer** at the same depth (`gpipe (muon)` for a Muon row; {opt} lr={lr:g}); "
        f"✓: within {100 * WITHIN:.0f} %. A row of another optimizer also gives its excess "
        f"over gpipe under {opt}. Copies: weight copies on the fullest stage (stage 0), from "
        f"the memory model.",
        "",
        "| method | " + " | ".join(f"P={p}" for p in config.stages) + " |",
        "|---|" + "---|" * len(config.stages),
    ]
    excesses = gaps(config, cells, rates)
    first = gaps(config, cells, rates, same_optimizer=False)
    for label in method_labels(config):
        row = []
        sync = synchronous_label(label)
        for p in config.stages:
            cell = cells.get((label, opt, lr, p))
            if cell is None:
                row.append("not run")
                continue
            loss = cell.final_test_loss
            if not math.isfinite(loss):
                row.append(f"— ✗{cell.diverged}")
                continue
            excess = excesses.get(p, {}).get(label, math.nan)  # nan: no finished yardstick
            mark = " ✓" if excess <= WITHIN else ""  # never for nan
            gap = f"{100 * excess:+.1f} %" if math.isfinite(excess) else f"no {sync} at P={p}"
            seeds = f" ({len(cell.finished)} seeds)" if len(cell.finished) > 1 else ""
            n = peak_copies(label, p)
            copies = "1 copy" if n == 1 else f"{n} copies"
            beside = ""
            if sync != "gpipe" and p in first and label in first[p]:
                beside = f"; {100 * first[p][label]:+.1f} % vs gpipe ({opt})"
            row.append(f"{loss:.3f} ({gap}){mark}{seeds}, {copies}{beside}")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines


def closure_rows(records: Iterable[RunRecord]) -> list[dict[str, Any]]:
    """One row per (model, method, optimizer, lr, stages, stage) with closure samples."""
    rows = []
    for r in records:
        for st in r.closure:
            rows.append(
                {
                    "model": r.spec.model,
                    "method": r.spec.label,
                    # the rule's own method and optimizer (a row "pipeoptim (nadam)" measures
                    # PipeOptim's rule under NAdam; a Ŵbackward variant is no planner method)
                    "rule_of": None if r.spec.predicted_backward else r.spec.method,
                    "optimizer": r.spec.trained_optimizer or r.spec.optimizer,
                    "lr": r.spec.lr,
                    "stages": r.spec.stages,
                    "stage": st["stage"],
                    "s": st["max_distance"],
                    "closed": 1.0 - st["median_ratio"],
                    "samples": st["samples"],
                }
            )
    return rows


def closure_table(rows: Sequence[dict[str, Any]], lr_of: dict[str, float]) -> list[str]:
    """Markdown: share of the stale distance removed, per stage (s in brackets)."""
    picked = [r for r in rows if r["lr"] == lr_of.get(r["optimizer"])]
    if not picked:
        return []
    width = max(r["stages"] for r in picked)
    lines = [
        "| method | optimizer | P | " + " | ".join(f"stage {k}" for k in range(width)) + " |",
        "|---|---|---|" + "---|" * width,
    ]
    keys = sorted({(r["method"], r["optimizer"], r["stages"]) for r in picked})
    for method, opt, p in keys:
        by_stage = {
            r["stage"]: r
            for r in picked
            if (r["method"], r["optimizer"], r["stages"]) == (method, opt, p)
        }
        cells = [
            f"{100 * by_stage[k]['closed']:.0f}% (s={by_stage[k]['s']})" if k in by_stage else ""
            for k in range(width)
        ]
        lines.append(f"| {method} | {opt} | {p} | " + " | ".join(cells) + " |")
    return lines


def _target_text(config: StudyConfig, sync: str, target: Target) -> str:
    if isinstance(target, Mapping):
        return (
            f"{sync}'s final test loss at each depth plus {100 * WITHIN:.0f} %, as perplexity ("
            + ", ".join(f"P={p}: {v:.3g}" for p, v in sorted(target.items()))
            + ")"
        )
    if higher_is_better(config.model):
        return f"{100 * target:.0f}% test accuracy"
    return f"test perplexity {target:g}"


def time_table(config: StudyConfig, rows: Sequence[TimeToTarget], targets: Targets) -> list[str]:
    """Markdown: each row's time to its target, against gpipe's and zb-h1's under the same
    optimizer (``zb-h1 (muon)`` for a Muon row: gpipe (muon)'s samples at zb-h1's time per
    sample, Muon's step cost charged to both)."""
    shared = len({str(t) for t in targets.values()}) == 1
    what = (
        _target_text(config, *next(iter(targets.items())))
        if shared
        else "that of gpipe under the row's own optimizer: "
        + "; ".join(_target_text(config, sync, t) for sync, t in targets.items())
    )
    lines = [
        f"Target: {what}. Samples: median over the seeds that reached it (evaluated once "
        f"per {config.eval_every} mini-batches). Time: samples x the simulated time per "
        f"sample of the method, depth and even partition on the hardware below (no link "
        f"cost; micro-batches cost 1/M of the mini-batch). vs gpipe, vs zb-h1: under the "
        f"row's own optimizer.",
        "",
        "| optimizer | P | method | reached | samples to target | simulated samples/s | "
        "predicted time to target (ms) | vs gpipe | vs zb-h1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    seconds = {(r.optimizer, r.method, r.stages): r.seconds for r in rows}

    def versus(r: TimeToTarget, twin: str) -> str:
        base = seconds.get((r.optimizer, synchronous_label(r.method, twin), r.stages), math.nan)
        return f"{r.seconds / base:.2f}x" if math.isfinite(r.seconds / base) else "—"

    for r in rows:
        samples = "never" if not math.isfinite(r.samples) else f"{r.samples:,.0f}"
        ms = "—" if not math.isfinite(r.seconds) else f"{1e3 * r.seconds:.3g}"
        lines.append(
            f"| {r.optimizer} | {r.stages} | {r.method} | {r.reached}/{r.seeds} | {samples} | "
            f"{1 / r.seconds_per_sample:,.0f} | {ms} | {versus(r, 'gpipe')} | "
            f"{versus(r, 'zb-h1')} |"
        )
    return lines


def _percent(excess: float) -> str:
    return f"{100 * excess:+.1f} %" if math.isfinite(excess) else "—"


def equal_time_table(config: StudyConfig, results: Sequence[EqualTimeResult]) -> list[str]:
    """Markdown: per depth, each equal-time row's final test loss after the updates its
    simulated throughput buys in the reference's (zb-h1's) time for the study's updates,
    against the reference's loss in that time (gpipe's final under the same optimizer)."""
    if not results:
        return []
    ref = config.equal_time_reference
    lines = [
        f"Budget: the simulated time {ref} under the row's optimizer needs for the study's "
        f"updates; each row trains as many updates as its own simulated throughput buys in it "
        f"(its schedule ending there), seed 0. {ref}'s loss in the budget is gpipe's final "
        f"loss (the same updates). vs {ref}: the row's loss over that, minus 1. Time to "
        f"{ref}'s loss: the share of the budget at the row's first evaluation (every "
        f"eval_every updates) at or below it, i.e. its time to gpipe's final loss over "
        f"{ref}'s; 'not within' where it ended above.",
        "",
        f"| P | row | updates in the budget | final test loss | vs {ref} | time to {ref}'s loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.not_simulated:
            loss = f"no budget: {r.not_simulated}"
        elif not r.run:
            loss = "no λ finished yet" if r.steps == 0 else "not run"
        elif not math.isfinite(r.loss):
            loss = "— (diverged)"
        else:
            loss = f"{r.loss:.3f}"
        steps = f"{r.steps:,}" if r.steps else "—"
        excess = _percent(r.excess) if r.run else "—"
        if not r.run or not math.isfinite(r.loss):
            when = "—"
        elif math.isfinite(r.reached_share):
            when = f"{r.reached_share:.2f}x"
        else:
            when = "not within"
        lines.append(f"| {r.stages} | {r.label} | {steps} | {loss} | {excess} | {when} |")
    return lines


def time_ratio_table(config: StudyConfig, rows: Sequence[TimeToTarget]) -> list[str]:
    """Markdown: per row (the first optimizer's column) and depth, the predicted time to
    gpipe's final test loss under the row's optimizer (``rows``: :func:`~pipeoptim.study.
    targets.time_to_target` against that target) as a share of the reference's (zb-h1's)
    under the same optimizer; ``not run`` where the row has not trained there."""
    opt = config.optimizers[0]
    ref = config.equal_time_reference
    seconds = {(r.method, r.stages): r for r in rows if r.optimizer == opt}
    labels = [*method_labels(config), *dict.fromkeys(r.method for r in rows if r.optimizer == opt)]
    lines = [
        f"Target: gpipe's final test loss under the row's own optimizer (no margin). Time: "
        f"samples to it (the first evaluation at or below it; median over seeds) x the "
        f"row's simulated time per sample at its micro-batches; shown as a share of "
        f"{ref}'s under the same optimizer (gpipe's samples at {ref}'s speed). never: no "
        f"evaluation reached it.",
        "",
        "| row | " + " | ".join(f"P={p}" for p in config.stages) + " |",
        "|---|" + "---|" * len(config.stages),
    ]
    for label in dict.fromkeys(labels):
        row = []
        for p in config.stages:
            mine = seconds.get((label, p))
            base = seconds.get((synchronous_label(label, ref), p))
            if mine is None:
                row.append("not run")
            elif not math.isfinite(mine.seconds):
                row.append(f"never ({mine.reached}/{mine.seeds})")
            elif base is None or not math.isfinite(base.seconds):
                row.append(f"— (no {synchronous_label(label, ref)})")
            else:
                row.append(f"{mine.seconds / base.seconds:.2f}x")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines


def closure_by_micro_batches_table(
    rows: Sequence[dict[str, Any]], lr_of: dict[str, float]
) -> list[str]:
    """Markdown: the share of the stale distance each plain prediction rule removed, per
    (method, optimizer, micro-batches per update M) and prediction distance s: the mean
    over the stages and depths with that s (the dial's rows at their M)."""
    picked = [
        r
        for r in rows
        if r["lr"] == lr_of.get(r["optimizer"])
        and r["rule_of"] in METHODS
        and METHODS[r["rule_of"]].correction is None  # a correction's closure is its own
    ]
    if not picked:
        return []
    by: dict[tuple[str, str, int], dict[int, list[float]]] = {}
    for r in picked:
        key = (r["rule_of"], r["optimizer"], row_micro_batches(r["method"], r["stages"]))
        by.setdefault(key, {}).setdefault(int(r["s"]), []).append(float(r["closed"]))
    distances = sorted({s for table in by.values() for s in table})
    lines = [
        "| method | optimizer | M | " + " | ".join(f"s={s}" for s in distances) + " |",
        "|---|---|---|" + "---|" * len(distances),
    ]
    for (method, opt, m), table in sorted(by.items()):
        cells = [
            f"{100 * sum(table[s]) / len(table[s]):.0f}%" if s in table else "" for s in distances
        ]
        lines.append(f"| {method} | {opt} | {m} | " + " | ".join(cells) + " |")
    return lines
