"""The study's results written out: ``README.md``, ``curves.html`` and ``risk_fit.json``.

:func:`write_study_report` reads each model's records and puts the parts together under
their headings, with the text around them; the parts are computed elsewhere:

* **Final table**, **prediction closure**, **time to target** tables
  (:mod:`pipeoptim.study.tables`): final test metric and training loss, mean ± std over
  seeds, per method x optimizer x depth (diverged runs counted apart); for pipeoptim,
  spectrain and xpipe, per stage, the share of the stale distance ‖W_f − W_b‖ the
  prediction removed (1 − median of ‖Ŵ − W_b‖/‖W_f − W_b‖).
* **Time to accuracy** (:mod:`pipeoptim.study.targets`): samples a method needs to reach
  the model's target metric (from its curves) x the simulated time per sample of that
  method, stages and partition on a profiled device (by default this machine, one thread
  per stage).
* **Curves** (:mod:`pipeoptim.study.plots`): test metric and training loss against samples
  seen, mean over seeds, and the time to target per method.
* **Risk fit**: the convergence-risk coefficients of ``pipeoptim.plan.risk`` fitted to the
  measured samples-to-target (:func:`pipeoptim.study.targets.risk_points`), gathered by
  :mod:`pipeoptim.study.risk_fit`.

Records are grouped into cells by :mod:`pipeoptim.study.cells`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeoptim.plan.profile import Profile
from pipeoptim.plan.risk import fit_risk
from pipeoptim.study.cells import aggregate, method_labels, rate_sets, synchronous_label
from pipeoptim.study.equal_time import EqualTimeResult, equal_time_results
from pipeoptim.study.grid import StudyConfig, sweep_specs
from pipeoptim.study.plots import curves_figures, time_figure
from pipeoptim.study.risk_fit import (
    TARGETS,
    Cells,
    Rates,
    RiskFitParts,
    closure_rates,
    model_records,
    model_targets,
)
from pipeoptim.study.tables import (
    closure_by_micro_batches_table,
    closure_rows,
    closure_table,
    equal_time_table,
    final_table,
    gap_table,
    time_ratio_table,
    time_table,
)
from pipeoptim.study.targets import (
    gpipe_finals,
    pinned_profiles,
    seconds_per_sample_of,
    time_to_target,
)

__all__ = ["TARGETS", "write_study_report"]


def _steps_text(config: StudyConfig) -> str:
    longer = {o: n for o, n in config.steps_by_optimizer.items() if o in config.optimizers}
    if not longer:
        return str(config.steps)
    return f"{config.steps} ({', '.join(f'{o}: {n}' for o, n in longer.items())})"


def _depth_sections(
    config: StudyConfig,
    cells: Cells,
    rates: Rates,
    closure: Sequence[dict[str, Any]],
    equal: Sequence[EqualTimeResult],
    profile: Profile,
    trained_profiles: Mapping[str, Profile],
) -> list[str]:
    """The language model's tables beyond equal samples (issue 65): the time to gpipe's
    final loss against zb-h1's, the loss in zb-h1's time, the closure per s and M."""
    md: list[str] = []
    ref = config.equal_time_reference
    at_final = {
        sync: gpipe_finals(config, cells, rates, within=0.0, label=sync)
        for sync in dict.fromkeys(synchronous_label(m) for m in method_labels(config))
    }
    at_final = {s: t for s, t in at_final.items() if t}
    times = time_to_target(config, cells, rates, at_final, profile, trained_profiles)
    md += [
        f"### Time to gpipe's final loss against {ref} (chosen rate)",
        "",
        *time_ratio_table(config, times),
        "",
    ]
    if config.equal_time:
        md += [f"### Equal time: the loss in {ref}'s time (chosen rate)", ""]
        md += [*equal_time_table(config, equal), ""] if equal else ["no rows yet", ""]
    table = closure_by_micro_batches_table(closure, closure_rates(config, rates))
    if table:
        md += [
            "### Prediction closure per s and M (chosen rate, seed 0)",
            "",
            "The share of the stale distance each plain prediction rule removed, by "
            "micro-batches per update M (the dial's rows at their M) and prediction distance "
            "s: the mean over the stages and depths with that s.",
            "",
            *table,
            "",
        ]
    return md


def write_study_report(
    out: Path,
    configs: Sequence[StudyConfig],
    profiles: Mapping[str, Profile] | None = None,
    *,
    produced_by: str = "python examples/convergence/run.py",
) -> Path:
    """Write ``README.md``, ``curves.html`` and ``risk_fit.json`` under ``out`` from each
    model's ``out/<model>/runs.jsonl``; returns the markdown file. ``profiles[model]`` is the
    hardware the time to target is simulated on (``pipeoptim profile`` of the same model;
    default: this machine, one thread per stage, profiled once into
    ``out/<model>/profile.json`` and reused). ``produced_by``: the command the report
    names as its producer (``pipeoptim compare`` passes its own)."""
    from pipeoptim.viz.report import offline_page

    md = ["# Convergence study: results", ""]
    md += [
        f"Produced by `{produced_by}` (every stage in one process: the "
        "local transport, bitwise equal to the distributed run). Each evaluation drains the "
        "pipeline, as a checkpoint does, so the first P−1 mini-batches after it run with a "
        "smaller prediction distance.",
        "",
    ]
    html_parts: list[str] = []
    parts = RiskFitParts()
    for config in configs:
        found = model_records(out, config)
        if found is None:
            md += [f"## {config.model}", "", "no runs recorded", ""]
            continue
        records, mine, rates = found
        cells = aggregate(mine)
        given = (profiles or {}).get(config.model)
        chosen, trained_profiles = pinned_profiles(out / config.model, config, given)
        per_sample = seconds_per_sample_of(config, chosen, trained_profiles)
        equal = (
            equal_time_results(config, rates, cells, records, per_sample)
            if config.equal_time
            else []
        )
        # runs of an earlier configuration (other steps or rates) stay on file, unused
        used = {r.spec.key for r in mine} | {s.key for s in sweep_specs(config)}
        used |= {r.key for r in equal if r.key}
        records = [r for r in records if r.spec.key in used]
        fixed = TARGETS.get(config.model)
        seconds = sum(r.seconds for r in records)
        md += [f"## {config.model}", ""]
        md.append(
            f"{len(mine)} runs of {_steps_text(config)} mini-batches of {config.batch_size} "
            f"({len(records)} with the sweep, {seconds / 60:.0f} min of training); rates "
            + ", ".join(
                f"{o}: {b:g}" + (f" (higher: {h:g})" if h and config.high_rate else "")
                for o, (b, h) in rates.items()
            )
            + " (best final test metric of gpipe in the sweep "
            + ", ".join(f"{o} {list(config.rates[o])}" for o in config.optimizers)
            + ")."
        )
        md.append("")
        for title, lr_of in rate_sets(config, rates):
            md += [f"### Final, {title}", "", *final_table(config, cells, lr_of), ""]
        if fixed is None:
            md += [
                "### Against gpipe under the same optimizer (chosen rate)",
                "",
                *gap_table(config, cells, rates),
                "",
            ]
        closure = closure_rows(mine)
        table = closure_table(closure, closure_rates(config, rates))
        if table:
            md += [
                "### Prediction closure (chosen rate, seed 0)",
                "",
                "Share of the stale distance ‖W_forward − W_backward‖ the prediction removed, "
                "1 − median ‖Ŵ − W_backward‖ / ‖W_forward − W_backward‖ over every predicted "
                "forward; s is the prediction distance. Stages without weights are blank.",
                "",
                *table,
                "",
            ]
        # each row is held to gpipe's final under its own optimizer, or to the fixed target
        targets = model_targets(config, cells, rates)
        parts.add_model(
            config, cells, rates, targets, closure, seconds_per_sample=per_sample, equal=equal
        )
        times = time_to_target(config, cells, rates, targets, chosen, trained_profiles)
        hardware = (
            f"Hardware: the profile given ({chosen.device}, batch {chosen.batch_size})."
            if profiles and config.model in profiles
            else f"Hardware: this machine's profile of the model, one thread per stage "
            f"({config.model}/profile.json, batch {chosen.batch_size})."
            + "".join(
                f" Rows under {o}: its update and prediction cost over "
                f"{chosen.optimizer}'s, timed on each unit's own weights "
                f"({config.model}/profile-{o}.json)."
                for o in trained_profiles
            )
        )
        md += [
            "### Time to target (chosen rate)",
            "",
            hardware,
            "",
            *time_table(config, times, targets),
            "",
        ]
        if fixed is None:
            md += _depth_sections(config, cells, rates, closure, equal, chosen, trained_profiles)
        html_parts.append(f"<h2>{config.model}</h2>")
        for fig in [*curves_figures(config, cells, rates), time_figure(config.model, times)]:
            html_parts.append(fig.to_html(full_html=False, include_plotlyjs=False))
    fit = fit_risk(parts.points)
    md += [
        "## Convergence-risk fit",
        "",
        "Extra samples to the target over gpipe, against the uncorrected distance e "
        "(`pipeoptim.plan.risk`), fitted through the origin per optimizer: extra ≈ κ·e.",
        "",
        "| optimizer | κ | points |",
        "|---|---|---|",
        *[f"| {opt} | {k:.3f} | {n} |" for opt, (k, n) in sorted(fit.items())],
        "",
    ]
    (out / "risk_fit.json").write_text(
        json.dumps(
            parts.fit(),
            indent=1,
        )
        + "\n"
    )
    (out / "curves.html").write_text(offline_page("pipeoptim convergence study", html_parts))
    path = out / "README.md"
    path.write_text("\n".join(md) + "\n")
    return path
