"""What the demo found, in words and one table: the recommendation sentence at the top of
the report and the summary table the command prints at the end.

Every number here comes from a step's stored result (a measurement, or the simulator's
prediction, said which), never from a constant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipeoptim.demo.predict import SYNCHRONOUS_RIVALS
from pipeoptim.plan.risk import depth_advice
from pipeoptim.plan.units import format_bytes, format_distances

__all__ = ["count", "recommendation", "study_advice", "summary_headers", "summary_rows"]


def summary_headers(results: Mapping[str, Any]) -> list[str]:
    """The summary table's columns (the test metrics say how many mini-batches they took)."""
    sizes = results["options"]["sizes"]
    return [
        "method",
        "role",
        "M",
        "simulated/s",
        "measured/s",
        "calibrated/s",
        "time error",
        f"test metric (real, {results['train_steps']} steps)",
        f"(1 device, {sizes['converge_steps']} steps)",
        "peak memory",
        "copies",
        "s per stage",
    ]


def _rate(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "n/a"


def count(n: int, noun: str) -> str:
    """``4 stages``, ``1 stage``, ``2 micro-batches``."""
    plural = noun + ("es" if noun.endswith("h") else "s")
    return f"{n} {noun if n == 1 else plural}"


def _by_method(plan: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(r["method"]): r for r in plan["methods"]}


def _measured_rate(results: Mapping[str, Any], method: str) -> float:
    run = results["calibrate"]["runs"][method]
    t = float(run["measured_s_per_mini_batch"])
    return results["options"]["batch_size"] / t if t > 0 else math.nan


def _predicted_rate(results: Mapping[str, Any], method: str) -> float:
    run = results["calibrate"]["runs"][method]
    t = float(run["predicted_s_per_mini_batch"])
    return results["options"]["batch_size"] / t if t > 0 else math.nan


def _final_metric(results: Mapping[str, Any], method: str) -> tuple[float, int] | None:
    run = results["converge"].get(method)
    if not run or not run["curve"]:
        return None
    last = run["curve"][-1]
    return float(last["test_metric"]), int(last["samples"])


def _metric_text(value: float | None, metric: str) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{100 * value:.1f}%" if metric == "accuracy" else f"{value:.3g}"


def _real_metric(run: Mapping[str, Any], metric: str) -> float | None:
    """The real run's final test metric: accuracy, or perplexity from its test loss."""
    if metric == "perplexity":
        loss = run.get("test_loss")
        return math.exp(loss) if loss is not None and loss < 700 else None
    value = run.get("test_accuracy")
    return None if value is None else float(value)


def recommendation(results: Mapping[str, Any]) -> str:
    """One sentence: what to run, and why (simulated and measured against the rival)."""
    plan, options = results["plan"], results["options"]
    best, rival = plan["recommended"], plan["rival"]
    rows = _by_method(plan)
    b, r = rows[best], rows[rival]
    sim = b["samples_per_s"] / r["samples_per_s"] if r["samples_per_s"] > 0 else math.nan
    m = int(b["micro_batches"])
    synchronous = best in SYNCHRONOUS_RIVALS  # then the rival is the other of the two
    who = "the other synchronous method" if synchronous else "the strongest synchronous method"
    text = (
        f"Run {best} on {count(options['stages'], 'stage')} "
        f"({count(m, 'micro-batch')}): "
        f"on this machine's profile the simulator predicts {_ratio(sim)} the throughput of "
        f"{rival}, {who} ({_rate(b['samples_per_s'])} against "
        f"{_rate(r['samples_per_s'])} samples/s"
    )
    if b["risk"] > 0:
        eff = b["effective_samples_per_s"] / r["effective_samples_per_s"]
        text += (
            f"; {_ratio(eff)} after its convergence risk of +{100 * b['risk']:.0f}% samples "
            f"to the same accuracy"
        )
    measured = _measured_rate(results, best) / _measured_rate(results, rival)
    if math.isfinite(measured):
        pace = f"{_ratio(measured)} as fast" if measured >= 1 else f"{_ratio(measured)} the speed"
        text += (
            f"), and trained for real here, one process per stage, it ran {pace} "
            f"({_rate(_measured_rate(results, best))} against "
            f"{_rate(_measured_rate(results, rival))} samples/s)"
        )
    else:
        text += ")"
    mine, theirs = _final_metric(results, best), _final_metric(results, rival)
    if mine is not None and theirs is not None:
        metric = results["converge"][best]["metric"]
        text += (
            f"; emulated on one device, it reached test {metric} "
            f"{_metric_text(mine[0], metric)} after {mine[1]:,} samples, against "
            f"{_metric_text(theirs[0], metric)}"
        )
    return text + "."


def study_advice(results: Mapping[str, Any]) -> str | None:
    """The advice ``pipeoptim plan`` gives for the recommended method, its micro-batches,
    the demo's optimizer and depth, from the convergence study's tables (None where they
    have nothing for it: the digits models' SGD, a depth below the study's)."""
    plan, options = results["plan"], results["options"]
    best = _by_method(plan)[plan["recommended"]]
    return depth_advice(
        str(best["method"]),
        int(options["stages"]),
        str(options["optimizer"]),
        int(best["micro_batches"]),
    )


def summary_rows(results: Mapping[str, Any]) -> list[list[str]]:
    """One row per trained method: simulated, measured and calibrated throughput, the
    calibration error, test metrics, memory, weight copies and s per stage."""
    plan = results["plan"]
    rows = _by_method(plan)
    out = []
    for method, role in ((plan["recommended"], "recommended"), (plan["rival"], "rival")):
        r = rows[method]
        cal = results["calibrate"]["runs"][method]["rows"][0]
        error = cal["relative_error"]
        real = results["train"][method]
        one = _final_metric(results, method)
        metric = results["converge"][method]["metric"] if method in results["converge"] else ""
        out.append(
            [
                method,
                role,
                str(r["micro_batches"]),
                _rate(float(r["samples_per_s"])),
                _rate(_measured_rate(results, method)),
                _rate(_predicted_rate(results, method)),
                "n/a" if error is None or not math.isfinite(error) else f"{100 * error:+.0f}%",
                _metric_text(_real_metric(real, metric), metric),
                _metric_text(one[0] if one else None, metric),
                format_bytes(int(r["peak_memory_bytes"])),
                format_distances([int(c) for c in real["weight_copies"]]),
                format_distances([int(s) for s in r["distances"]]),
            ]
        )
    return out
