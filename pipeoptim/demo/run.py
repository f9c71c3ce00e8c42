"""The demo's driver: the six steps in order, each skipped when its result file is current.

A step is a name, its inputs (options and the fingerprints of the steps it reads) and the
work that produces its result and files (:mod:`pipeoptim.demo.resume` stores them). The
real runs and the convergence runs are one step per method, so an interruption during the
second keeps the first. Progress goes to stderr, one line per step (the long steps show a
bar where stderr is a terminal); the summary is the caller's to print.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeoptim import __version__
from pipeoptim.demo import measure
from pipeoptim.demo.options import DemoOptions, check_out_dir, check_stages
from pipeoptim.demo.resume import StepStore, fingerprint, write_atomic
from pipeoptim.errors import PlanError

__all__ = ["DemoOutcome", "run_demo"]

STEPS = 6


@dataclass
class DemoOutcome:
    """What a finished demo produced."""

    report: Path
    recommendation: str
    headers: list[str]
    summary: list[list[str]]
    steps: list[tuple[str, str, float]] = field(default_factory=list)
    """(step, ``ran`` or ``skipped``, seconds) in order."""
    files: list[str] = field(default_factory=list)
    """The files this demo's steps wrote (or found current), relative to ``--out``."""
    results: dict[str, Any] = field(default_factory=dict)
    """Every step's result (plain data: what the report is drawn from)."""
    study_advice: str | None = None
    """What the convergence study says of the recommended configuration under the demo's
    optimizer at its depth (``pipeoptim.plan.risk.depth_advice``; None: nothing to add)."""


Work = Callable[[], tuple[dict[str, Any], Sequence[Path]]]


class _Steps:
    def __init__(self, out: Path, log: Callable[[str], None]) -> None:
        self.store, self.log = StepStore(out), log
        self.done: list[tuple[str, str, float]] = []
        self.files: list[str] = []
        """This run's files, relative to the folder: each step's, then its result file."""

    def run(
        self, number: int, name: str, what: str, inputs: Mapping[str, Any], work: Work
    ) -> tuple[dict[str, Any], str]:
        """Step ``name``'s result and fingerprint: the stored one when current, else run it."""
        key = fingerprint(inputs)
        label = f"[{number}/{STEPS}] {name}"
        stored = self.store.load(name, key)
        rel = str(self.store.path(name).relative_to(self.store.out))
        if stored is not None:
            self.log(f"{label}: skipped, {rel} is there and matches its inputs")
            self.done.append((name, "skipped", 0.0))
            self.files += [*stored["files"], rel]
            return stored["result"], key
        self.log(f"{label}: {what}")
        start = time.perf_counter()
        result, files = work()
        seconds = time.perf_counter() - start
        self.store.save(name, key, inputs, result, files, seconds)
        self.log(f"{label}: done in {seconds:.1f} s")
        self.done.append((name, "ran", seconds))
        self.files += [*(str(f.relative_to(self.store.out)) for f in files), rel]
        return result, key


def _check(options: DemoOptions) -> None:
    """Everything about the options, before any work (an unknown model raises here)."""
    check_stages(options.stages)
    check_out_dir(options.out)
    layers = measure.count_layers(options.model, options.seed)
    if options.stages > layers:
        raise PlanError(
            f"--stages {options.stages} is more stages than model {options.model!r} has layers "
            f"({layers}); each stage holds at least one layer, so use --stages {layers} or fewer"
        )


def _model_source(model: str) -> str | None:
    """A hash of a ``path.py:factory`` model's file, so editing the model reruns the demo's
    steps (a built-in or an importable module is named by its name alone)."""
    import hashlib

    path = Path(model.rpartition(":")[0])
    if ":" not in model or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run_demo(options: DemoOptions, log: Callable[[str], None] | None = None) -> DemoOutcome:
    """Run (or resume) the demo into ``options.out``; returns the report and the summary."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    _check(options)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    steps = _Steps(out, say)
    try:
        return _run(options, steps)
    except KeyboardInterrupt:
        kept = len(steps.done)
        say(
            f"interrupted: {kept} finished step(s) are kept in {out}; run the same command "
            f"again to resume from there"
        )
        raise


def _run(options: DemoOptions, steps: _Steps) -> DemoOutcome:
    from pipeoptim.demo.predict import calibrate_runs, plan_methods
    from pipeoptim.plan.plan import Plan
    from pipeoptim.plan.profile import Profile
    from pipeoptim.trace import Trace

    out, p = options.out, options.stages
    base = {"version": __version__, "model": options.model, "stages": p, "seed": options.seed}
    base |= {"batch_size": options.batch_size, "optimizer": options.optimizer, "lr": options.lr}
    base["model_source"] = _model_source(options.model)

    def do_profile() -> tuple[dict[str, Any], list[Path]]:
        prof = measure.profile(options, out / "profile.json")
        meta = prof.meta
        result = {
            "layers": prof.num_layers,
            "device": prof.device,
            "threads": meta.get("threads"),
            "torch": meta.get("torch_version"),
            "cpus": os.cpu_count() or 1,
            "batch_size": prof.batch_size,
        }
        return result, [out / "profile.json"]

    profile_inputs = {**base, "repeats": options.sizes.profile_repeats, "cpus": os.cpu_count()}
    profile_inputs["device"] = measure.run_device(p)
    what = f"profiling {options.model} as each of {p} ranks on this machine will run it"
    profile_result, profile_key = steps.run(1, "profile", what, profile_inputs, do_profile)
    profile = Profile.load(out / "profile.json")

    def do_plan() -> tuple[dict[str, Any], list[Path]]:
        result = plan_methods(
            profile,
            p,
            optimizer=options.optimizer,
            lr=options.lr,
            model=options.model,
            batch_size=options.batch_size,
        )
        files = []
        for method, data in result["plans"].items():
            path = out / f"plan-{method}.json"
            files.append(write_atomic(path, Plan.from_dict(data).save))
        return result, files

    what = f"planning {p} stages and simulating every method on the profile"
    plan, plan_key = steps.run(2, "plan", what, {**base, "profile": profile_key}, do_plan)
    trained = [plan["recommended"], plan["rival"]]
    train_steps = _train_steps(options, plan, trained)

    train: dict[str, Any] = {}
    train_keys: dict[str, str] = {}
    for method in trained:

        def do_train(method: str = method) -> tuple[dict[str, Any], list[Path]]:
            trace = out / f"trace-{method}.json"
            plan_of = Plan.from_dict(plan["plans"][method])
            return measure.train_for_real(options, plan_of, trace, train_steps), [trace]

        inputs = {**base, "plan": plan_key, "method": method}
        inputs["steps"] = train_steps
        what = (
            f"training {method} for real: {p} processes, {train_steps} "
            f"mini-batches of {options.batch_size}"
        )
        train[method], train_keys[method] = steps.run(3, f"train-{method}", what, inputs, do_train)

    measured = {m: Trace.load(out / f"trace-{m}.json") for m in trained}

    def do_calibrate() -> tuple[dict[str, Any], list[Path]]:
        result, predicted = calibrate_runs(measured, profile)
        files = [write_atomic(out / f"predicted-{m}.json", t.save) for m, t in predicted.items()]
        return result, files

    inputs = {**base, "profile": profile_key, "runs": train_keys}
    what = "calibrating the simulator from both runs"
    calibration, calibrate_key = steps.run(4, "calibrate", what, inputs, do_calibrate)

    converge: dict[str, Any] = {}
    converge_keys: dict[str, str] = {}
    sizes = options.sizes
    for method in trained:

        def do_converge(method: str = method) -> tuple[dict[str, Any], list[Path]]:
            return measure.converge(options, method), []

        inputs = {**base, "method": method, "steps": sizes.converge_steps}
        inputs |= {"eval_every": sizes.eval_every, "eval_samples": sizes.eval_samples}
        what = (
            f"convergence of {method}: {p} stages emulated on one device, "
            f"{sizes.converge_steps} mini-batches"
        )
        converge[method], converge_keys[method] = steps.run(
            5, f"converge-{method}", what, inputs, do_converge
        )

    results = {
        "options": options.describe(),
        "profile": profile_result,
        "plan": plan,
        "train": train,
        "train_steps": train_steps,
        "calibrate": calibration,
        "converge": converge,
    }

    def do_report() -> tuple[dict[str, Any], list[Path]]:
        from pipeoptim.demo.report import build_figures, render_page, write_figures
        from pipeoptim.demo.summary import recommendation

        predicted = {m: Trace.load(out / f"predicted-{m}.json") for m in trained}
        figures = build_figures(results, measured, predicted)
        written = write_figures(figures, out / "figures")
        names = [*steps.files, *(f"figures/{n}.json" for n in figures), "report.html"]
        page = render_page(results, figures, [*names, "steps/report.json"])
        report = write_atomic(out / "report.html", lambda f: f.write_text(page, "utf-8"))
        return {"recommendation": recommendation(results), "figures": list(figures)}, [
            *written,
            report,
        ]

    keys = {"calibrate": calibrate_key, "plan": plan_key, "converge": converge_keys}
    what = "writing the report and the JSON of every figure"
    report, _ = steps.run(6, "report", what, {**base, **keys}, do_report)
    from pipeoptim.demo.summary import study_advice, summary_headers, summary_rows

    return DemoOutcome(
        report=out / "report.html",
        recommendation=str(report["recommendation"]),
        headers=summary_headers(results),
        summary=summary_rows(results),
        steps=steps.done,
        files=steps.files,
        results=results,
        study_advice=study_advice(results),
    )


def _train_steps(options: DemoOptions, plan: Mapping[str, Any], trained: Sequence[str]) -> int:
    """Mini-batches of each real run: about ``train_budget_s`` of the slower of ``trained``
    at its predicted throughput (the plan's rows), within the sizes' bounds."""
    rates = [r["samples_per_s"] for r in plan["methods"] if r["method"] in trained]
    return options.sizes.train_steps_for(min(rates, default=0.0), options.batch_size)
