"""The study's grid (rate choice, specs, resume), its report on known records, and the
``pipeoptim compare`` command end to end on a tiny configuration."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.study import grid
from pipeoptim.study.grid import StudyConfig, choose_rates, load_records, main_specs, run_specs
from pipeoptim.study.report import write_study_report
from pipeoptim.study.runs import CurvePoint, RunRecord, RunSpec
from pipeoptim.study.targets import samples_to_target

CONFIG = StudyConfig(
    "mlp",
    steps=4,
    eval_every=2,
    methods=("gpipe", "pipedream"),
    optimizers=("adam",),
    stages=(2,),
    seeds=2,
    rates={"adam": (1e-3, 2e-3)},
    sweep_stages=2,
)


def record(spec: RunSpec, accuracies: list[float], diverged: int | None = None) -> RunRecord:
    curve = [
        CurvePoint(2 * (i + 1), 64 * (i + 1), 1.0 - a, a, 0.5 / (i + 1))
        for i, a in enumerate(accuracies)
    ]
    return RunRecord(spec, curve, diverged, 1.0)


def test_rates_best_then_next_candidate() -> None:
    sweep = [
        record(CONFIG.spec("gpipe", "adam", 1e-3, 2, 0), [0.9, 0.96]),
        record(CONFIG.spec("gpipe", "adam", 2e-3, 2, 0), [0.9, 0.93]),
    ]
    assert choose_rates(CONFIG, sweep) == {"adam": (1e-3, 2e-3)}
    sweep[0] = record(sweep[0].spec, [0.99], diverged=3)  # a diverged run never wins
    assert choose_rates(CONFIG, sweep) == {"adam": (2e-3, None)}
    with pytest.raises(RuntimeConfigError, match=r"sweep run .* is missing"):
        choose_rates(CONFIG, sweep[:1])


def test_main_specs_cover_every_method_depth_seed_and_rate() -> None:
    specs = main_specs(CONFIG, {"adam": (1e-3, 2e-3)})
    assert len(specs) == 2 * 2 * 2  # methods x seeds x (chosen, higher rate)
    assert {s.lr for s in specs} == {1e-3, 2e-3}
    assert all(s.steps == 4 and s.batch_size == 32 for s in specs)
    # closure is measured on seed 0 of predicting methods only
    assert not any(s.closure for s in specs)
    assert CONFIG.spec("pipeoptim", "adam", 1e-3, 2, 0).closure


def test_run_specs_resume_and_skip_a_torn_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []

    def fake(spec: RunSpec) -> RunRecord:
        ran.append(spec.key)
        return record(spec, [0.5, 0.97])

    monkeypatch.setattr(grid, "run_one", fake)
    specs = main_specs(CONFIG, {"adam": (1e-3, None)})
    path = tmp_path / "runs.jsonl"
    first = run_specs(specs[:2], path)
    assert len(ran) == 2 and [r.spec for r in first] == specs[:2]
    with path.open("a") as f:
        f.write('{"key": "torn')  # an interrupted write
    again = run_specs(specs, path)
    assert len(ran) == len(specs)  # only the two new ones ran
    assert [r.spec for r in again] == specs
    assert len(load_records(path)) == len(specs)


def test_samples_to_target_both_directions() -> None:
    acc = record(RunSpec("mlp", "gpipe", "adam", 1e-3, 2, 0, 6, 2), [0.5, 0.95, 0.97])
    assert samples_to_target(acc, 0.95) == 128
    assert samples_to_target(acc, 0.99) is None
    ppl = RunRecord(
        RunSpec("gpt", "gpipe", "adamw", 1e-3, 2, 0, 4, 2),
        [CurvePoint(2, 64, 3.0, 20.0, 3.1), CurvePoint(4, 128, 2.4, 11.0, 2.5)],
        None,
        1.0,
    )
    assert samples_to_target(ppl, 12.0) == 128


def test_report_tables_and_risk_fit_from_known_records(tmp_path: Path) -> None:
    records = [
        record(CONFIG.spec("gpipe", "adam", 1e-3, 2, 0), [0.96, 0.97]),
        record(CONFIG.spec("gpipe", "adam", 2e-3, 2, 0), [0.9, 0.93]),
        record(CONFIG.spec("gpipe", "adam", 1e-3, 2, 1), [0.96, 0.97]),
        record(CONFIG.spec("pipedream", "adam", 1e-3, 2, 0), [0.9, 0.96]),
        record(CONFIG.spec("pipedream", "adam", 1e-3, 2, 1), [0.9, 0.98]),
        record(CONFIG.spec("gpipe", "adam", 2e-3, 2, 1), [0.9, 0.94]),
        record(CONFIG.spec("pipedream", "adam", 2e-3, 2, 0), [0.5], diverged=3),
        record(CONFIG.spec("pipedream", "adam", 2e-3, 2, 1), [0.5], diverged=3),
    ]
    folder = tmp_path / "mlp"
    folder.mkdir()
    (folder / "runs.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    text = write_study_report(tmp_path, [CONFIG]).read_text()
    chosen, higher = text.split("### Final, higher rate")
    assert "| gpipe | 97.0 ± 0.0 / 0.25 ± 0 |" in chosen
    assert "| pipedream | 97.0 ± 1.4 / 0.25 ± 0 |" in chosen
    assert "| gpipe | 93.5 ± 0.7 / 0.25 ± 0 |" in higher
    assert "| pipedream | — / — ✗2 |" in higher
    assert "| adam | 2 | gpipe | 2/2 | 64 |" in text
    assert "| adam | 2 | pipedream | 2/2 | 128 |" in text
    fit = json.loads((tmp_path / "risk_fit.json").read_text())
    # pipedream at P = 2: e = s = 1 and it needs twice gpipe's samples: κ = 1
    assert fit["kappa"] == {"adam": 1.0}
    assert (tmp_path / "curves.html").stat().st_size > 100_000


def test_compare_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "compare",
            "--model",
            "mlp",
            "--methods",
            "gpipe,pipeoptim",
            "--optimizers",
            "adam",
            "--stages",
            "2",
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--lr-candidates",
            "adam=2e-3",
            "--workers",
            "1",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "| pipeoptim | " in out and "| gpipe | " in out
    assert "| pipeoptim | adam | 2 | " in out  # its closure row
    rows = load_records(tmp_path / "mlp" / "runs.jsonl")
    assert sorted(r.spec.method for r in rows) == ["gpipe", "pipeoptim"]  # sweep run reused
    assert all(len(r.curve) == 1 and r.curve[0].step == 44 for r in rows)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--lr-candidates", "adam", "OPT=LR,LR"),
        ("--methods", "gpipe,nope", "unknown nope"),
        ("--stages", "4,x", "depths >= 1"),
        ("--model", "resnet", "built-in model"),
        ("--warmup", "1.5", "warmup is a share of the run in [0, 1) (got 1.5)"),
        ("--final-lr", "0", "final_lr is a share of the rate in (0, 1] (got 0.0)"),
        ("--grad-clip", "-1", "grad_clip must be positive (got -1.0)"),
        ("--optimizers", "adagrad", "unknown adagrad; choose from sgd, adam, adamw, nadam, muon"),
    ],
)
def test_compare_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    assert main(["compare", flag, value, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_variants_and_longer_runs_per_optimizer() -> None:
    config = replace(
        CONFIG,
        methods=("gpipe", "pipeoptim"),
        optimizers=("adam", "sgd"),
        rates={"adam": (1e-3,), "sgd": (0.02,)},
        steps_by_optimizer={"adam": 6},
        variants=("pipeoptim",),
    )
    specs = main_specs(config, {"adam": (1e-3, None), "sgd": (0.02, None)})
    labels = sorted({(s.optimizer, s.label, s.steps) for s in specs})
    assert labels == [
        ("adam", "gpipe", 6),
        ("adam", "pipeoptim", 6),
        ("adam", "pipeoptim+Ŵbackward", 6),
        ("sgd", "gpipe", 4),
        ("sgd", "pipeoptim", 4),
        ("sgd", "pipeoptim+Ŵbackward", 4),
    ]
    variant = next(s for s in specs if s.predicted_backward and s.seed == 0)
    assert variant.closure and "pipeoptim+Ŵbackward/" in variant.key
    with pytest.raises(RuntimeConfigError, match="do not predict"):
        replace(CONFIG, variants=("pipedream",))


def test_time_to_target_on_a_chosen_hardware_profile(tmp_path: Path) -> None:
    from pipeoptim.plan.profile import Profile
    from pipeoptim.study.targets import simulated_seconds_per_sample

    records = [
        record(CONFIG.spec("gpipe", "adam", 1e-3, 2, seed), [0.96, 0.97]) for seed in (0, 1)
    ] + [record(CONFIG.spec("gpipe", "adam", 2e-3, 2, 0), [0.9, 0.93])]
    (tmp_path / "mlp").mkdir()
    (tmp_path / "mlp" / "runs.jsonl").write_text(
        "".join(json.dumps(r.to_dict()) + "\n" for r in records)
    )
    hardware = Profile.uniform(9, forward_s=0.5, backward_s=1.0, batch_size=32)
    text = write_study_report(tmp_path, [CONFIG], {"mlp": hardware}).read_text()
    assert "Hardware: the profile given (synthetic, batch 32)." in text
    rate = 1 / simulated_seconds_per_sample(hardware, "gpipe", 2)
    assert f"| adam | 2 | gpipe | 2/2 | 64 | {rate:,.0f} |" in text
    with pytest.raises(RuntimeConfigError, match="has 4 layers but the model has 9"):
        write_study_report(tmp_path, [CONFIG], {"mlp": Profile.uniform(4)})


def test_the_fit_reads_only_the_closure_measured_in_the_cell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The risk fit must not read the constants it produces (plan/risk.py CLOSURE)."""
    from pipeoptim.plan import risk
    from pipeoptim.study.targets import _measured_distance

    monkeypatch.setattr(risk, "CLOSURE", {("optimizer", "adam"): {1: -5.0, 2: -5.0, 3: -5.0}})
    # pipeoptim, P = 4: s = 3, 2, 1, 0; stage 1 measured nothing (no weights)
    assert _measured_distance("pipeoptim", "adam", 4, {0: 0.5, 2: 0.0}) == 1.5
    assert _measured_distance("pipeoptim", "adam", 4, {0: 0.9, 2: 0.0}) == 1.0  # stage 2: s=1
    assert _measured_distance("pipedream", "adam", 4, {}) == 3.0


def test_compare_refuses_a_profile_of_another_model_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeoptim.plan.profile import Profile

    wrong = tmp_path / "four.json"
    Profile.uniform(4).save(wrong)
    argv = ["compare", "--model", "mlp", "--out", str(tmp_path / "out"), "--profile"]
    assert main([*argv, str(wrong)]) == 2
    err = capsys.readouterr().err
    assert "has 4 layers but the model has 9" in err and "pipeoptim profile --model mlp" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written
    assert main([*argv, str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "Traceback" not in err


def test_rows_under_another_optimizer_are_simulated_at_its_update_cost() -> None:
    """A ``method (muon)`` row takes its time per sample from the profile of its own
    optimizer; the other rows keep the study's profile."""
    from pipeoptim.plan.profile import Profile
    from pipeoptim.study.cells import aggregate
    from pipeoptim.study.targets import simulated_seconds_per_sample, time_to_target

    config = replace(CONFIG, pairs=(("pipedream", "muon"),))
    records = [
        record(config.spec("gpipe", "adam", 1e-3, 2, 0), [0.96, 0.97]),
        record(config.spec("pipedream", "adam", 1e-3, 2, 0), [0.9]),
        record(config.spec("pipedream", "adam", 1e-3, 2, 0, trained_optimizer="muon"), [0.97]),
    ]
    cells = aggregate(records)
    plain = Profile.uniform(9, forward_s=0.5, backward_s=1.0, batch_size=32)
    slow = dataclasses.replace(
        plain, layers=tuple(dataclasses.replace(x, update_s=2.0) for x in plain.layers)
    )
    rates = {"adam": (1e-3, None)}
    # a fixed target: every row's, its optimizer's gpipe or not
    TARGETS = {"gpipe": 0.95, "gpipe (muon)": 0.95}
    times = {
        t.method: t.seconds_per_sample
        for t in time_to_target(config, cells, rates, TARGETS, plain, {"muon": slow})
    }
    assert times["gpipe"] == simulated_seconds_per_sample(plain, "gpipe", 2)
    # the same schedule and depth, two optimizers: two simulations, not one cached
    assert times["pipedream"] == simulated_seconds_per_sample(plain, "pipedream", 2)
    assert times["pipedream (muon)"] == simulated_seconds_per_sample(slow, "pipedream", 2)
    assert times["pipedream (muon)"] > simulated_seconds_per_sample(plain, "pipedream", 2)
    untouched = time_to_target(config, cells, rates, TARGETS, plain)
    assert {t.seconds_per_sample for t in untouched if t.method == "pipedream (muon)"} == {
        simulated_seconds_per_sample(plain, "pipedream", 2)
    }


def test_optimizer_profile_keeps_the_passes_and_adds_the_update_cost() -> None:
    from pipeoptim.plan.profile import Profile
    from pipeoptim.study.targets import optimizer_profile

    base = Profile.uniform(9, forward_s=0.5, backward_s=1.0, batch_size=32, optimizer="adamw")
    muon = optimizer_profile(base, "mlp", "muon")
    assert muon.optimizer == "muon" and muon.meta["update_times_of"] == "muon"
    for before, after in zip(base.layers, muon.layers, strict=True):
        assert (after.forward_s, after.backward_s) == (before.forward_s, before.backward_s)
    # the base costs nothing to update: Newton–Schulz on a weight matrix costs something,
    # in the step and once per update in the prediction (its per-update setup, the writes
    # then costing about AdamW's), and Muon's momentum buffer (plus AdamW's two moments for
    # the biases) is its state
    assert any(x.update_s > 0 and (x.prediction_setup_s or 0) > 0 for x in muon.layers)
    assert sum(layer.optimizer_state_bytes for layer in muon.layers) > 0
    with pytest.raises(RuntimeConfigError, match="has 4 layers but the model has 9"):
        optimizer_profile(Profile.uniform(4), "mlp", "muon")


def test_pairs_only_at_the_sweep_depth() -> None:
    config = replace(
        CONFIG,
        stages=(2, 4),
        seeds=1,
        pairs=(("pipedream", "muon"), ("gpipe", "muon")),
        pairs_only_at_sweep_depth=("pipedream (muon)",),
    )
    specs = [s for s in main_specs(config, {"adam": (1e-3, None)}) if s.trained_optimizer]
    assert sorted((s.method, s.stages) for s in specs) == [
        ("gpipe", 2),
        ("gpipe", 4),
        ("pipedream", 2),
    ]
    with pytest.raises(RuntimeConfigError, match=r"not pairs: \['xpipe \(muon\)'\]"):
        replace(config, pairs_only_at_sweep_depth=("xpipe (muon)",))


def test_a_correction_under_another_optimizer_gains_against_that_optimizers_rows() -> None:
    """pipeoptim+nesterov (muon) is scored against pipeoptim (muon) and gpipe (muon), so
    its gain is the correction's alone; pipedream+nesterov (nadam), with no nadam rows to
    compare with, against the first optimizer's (optimizer and correction together)."""
    from pipeoptim.study.cells import aggregate
    from pipeoptim.study.targets import correction_gains

    config = replace(
        CONFIG,
        methods=("gpipe", "pipedream", "pipeoptim"),
        seeds=1,
        pairs=(
            ("pipeoptim", "muon"),
            ("gpipe", "muon"),
            ("pipeoptim+nesterov", "muon"),
            ("pipedream+nesterov", "nadam"),
        ),
    )
    losses = {  # final test loss = 1 − accuracy in these records
        ("gpipe", None): 0.50,
        ("pipedream", None): 0.90,
        ("pipeoptim", None): 0.90,
        ("gpipe", "muon"): 0.40,
        ("pipeoptim", "muon"): 0.60,
        ("pipeoptim+nesterov", "muon"): 0.45,
        ("pipedream+nesterov", "nadam"): 0.70,
    }
    records = [
        record(config.spec(m, "adam", 1e-3, 2, 0, trained_optimizer=o), [1.0 - value])
        for (m, o), value in losses.items()
    ]
    gains = {
        (g["method"], g["optimizer"]): g["gain"]
        for g in correction_gains(config, aggregate(records), {"adam": (1e-3, None)})
    }
    assert gains[("pipeoptim+nesterov (muon)", "muon")] == pytest.approx(1 - 0.05 / 0.20)
    assert gains[("pipedream+nesterov (nadam)", "nadam")] == pytest.approx(1 - 0.20 / 0.40)


def test_the_report_keeps_an_optimizer_profile_beside_this_machines_and_renews_it(
    tmp_path: Path,
) -> None:
    """On this machine's pinned profile, rows under another optimizer get a
    ``profile-<optimizer>.json`` beside it, reused while the base is the same and made again
    once the base is taken again; a profile the user gives gets none."""
    from pipeoptim.plan.profile import Profile
    from pipeoptim.study.targets import profile_fingerprint

    config = replace(CONFIG, seeds=1, pairs=(("pipedream", "muon"),))
    records = [
        record(config.spec("gpipe", "adam", 1e-3, 2, 0), [0.96, 0.97]),
        record(config.spec("gpipe", "adam", 2e-3, 2, 0), [0.9, 0.93]),
        record(config.spec("pipedream", "adam", 1e-3, 2, 0, trained_optimizer="muon"), [0.97]),
    ]
    (tmp_path / "mlp").mkdir()
    (tmp_path / "mlp" / "runs.jsonl").write_text(
        "".join(json.dumps(r.to_dict()) + "\n" for r in records)
    )
    base = Profile.uniform(9, forward_s=0.5, backward_s=1.0, batch_size=32, optimizer="adam")
    base.save(tmp_path / "mlp" / "profile.json")  # as if this machine's, taken earlier
    text = write_study_report(tmp_path, [config]).read_text()
    kept = tmp_path / "mlp" / "profile-muon.json"
    assert "Rows under muon: its update and prediction cost over adam's" in text
    assert Profile.load(kept).meta["base"] == profile_fingerprint(base)
    made = kept.stat().st_mtime_ns
    write_study_report(tmp_path, [config])
    assert kept.stat().st_mtime_ns == made  # reused
    again = Profile.uniform(9, forward_s=0.7, backward_s=1.0, batch_size=32, optimizer="adam")
    again.save(tmp_path / "mlp" / "profile.json")
    write_study_report(tmp_path, [config])
    assert Profile.load(kept).meta["base"] == profile_fingerprint(again)  # made again
    kept.unlink()
    given = write_study_report(tmp_path, [config], {"mlp": base}).read_text()
    assert "Rows under muon" not in given and not kept.exists()


def test_sweep_depth_pairs_need_the_sweep_depth_among_the_stages() -> None:
    with pytest.raises(RuntimeConfigError, match=r"sweep_stages=8, which is not among"):
        replace(
            CONFIG,
            stages=(2,),
            sweep_stages=8,
            pairs=(("pipedream", "muon"),),
            pairs_only_at_sweep_depth=("pipedream (muon)",),
        )
    with pytest.raises(RuntimeConfigError, match=r"their seed 0 would be missing"):
        replace(
            CONFIG,
            stages=(2, 4),
            pairs=(("pipedream", "muon"),),
            pairs_only_at_sweep_depth=("pipedream (muon)",),
            repeat=("pipedream (muon)",),
            repeat_seeds=3,
            repeat_stages=4,
        )


def test_runs_are_scheduled_longest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batched runs at depth and Muon runs start before one-micro-batch AdamW runs."""
    deep = replace(CONFIG, stages=(2, 8), sweep_stages=2)
    quick = deep.spec("pipedream", "adam", 1e-3, 2, 0)
    muon = deep.spec("pipedream", "adam", 1e-3, 2, 0, trained_optimizer="muon")
    shallow = deep.spec("gpipe", "adam", 1e-3, 2, 0)
    micro = deep.spec("gpipe", "adam", 1e-3, 8, 0)
    assert grid.relative_cost(micro) > grid.relative_cost(shallow) > grid.relative_cost(quick)
    assert grid.relative_cost(muon) > grid.relative_cost(quick)
    started: list[str] = []

    def fake_run(spec: RunSpec) -> RunRecord:
        started.append(spec.label + f"/P={spec.stages}")
        return record(spec, [0.5])

    monkeypatch.setattr(grid, "run_one", fake_run)
    run_specs([quick, shallow, muon, micro], tmp_path / "runs.jsonl")
    assert started == ["gpipe/P=8", "pipedream (muon)/P=2", "gpipe/P=2", "pipedream/P=2"]


def test_one_candidate_rate_runs_the_sweep_in_the_main_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the rate known before the sweep, every run goes into one pool (no idle worker
    while a lone sweep run trains); the result is the main runs', as with a sweep."""
    single = replace(CONFIG, rates={"adam": (1e-3,)}, seeds=1)
    calls: list[int] = []
    real = grid.run_specs

    def counting(specs: list[RunSpec], path: Path, **kwargs: object) -> list[RunRecord]:
        calls.append(len(specs))
        return real(specs, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(grid, "run_one", lambda spec: record(spec, [0.5]))
    monkeypatch.setattr(grid, "run_specs", counting)
    rates, main = grid.run_study(single, tmp_path, quiet=True)
    assert rates == {"adam": (1e-3, None)}
    assert calls == [1 + 2]  # the sweep's gpipe run and the two main runs, in one call
    assert [r.spec.key for r in main] == [s.key for s in main_specs(single, rates)]
    assert len(load_records(tmp_path / "runs.jsonl")) == 2  # the sweep run is a main run


def test_a_results_folder_of_another_model_definition_is_refused(tmp_path: Path) -> None:
    """The run key names the model, not its definition: a folder records the definition it
    was trained on, and new runs of a changed one are refused instead of mixed in."""
    grid.check_model(tmp_path, "mlp")
    kept = json.loads((tmp_path / "model.json").read_text())
    assert kept["model"] == "mlp" and kept["units"] > 0 and kept["sample_shape"] == [64]
    grid.check_model(tmp_path, "mlp")  # the same definition: accepted
    (tmp_path / "model.json").write_text(json.dumps({**kept, "sample_shape": [32]}))
    with pytest.raises(RuntimeConfigError, match=r"another model\. Move .* away"):
        grid.check_model(tmp_path, "mlp")


def test_compare_refuses_a_results_folder_of_another_model_definition(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the command line: exit 2 with the fix, no traceback, the folder untouched."""
    kept = tmp_path / "mlp" / "model.json"
    kept.parent.mkdir()
    kept.write_text(json.dumps({"model": "mlp", "units": 1}))
    args = ["compare", "--model", "mlp", "--stages", "2", "--seeds", "1", "--epochs", "1"]
    assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Move" in err and "give another output folder" in err and "Traceback" not in err
    assert json.loads(kept.read_text()) == {"model": "mlp", "units": 1}
    assert sorted(p.name for p in kept.parent.iterdir()) == ["model.json"]


def test_a_profile_field_added_since_leaves_the_fingerprint_of_an_older_profile() -> None:
    """A layer field the format gained later, unmeasured (None), does not make the optimizer
    profiles kept beside the study's runs stale: the committed ones stay the study's own."""
    from pipeoptim.plan.profile import Profile
    from pipeoptim.study.targets import profile_fingerprint

    base = Profile.uniform(4, forward_s=0.5, backward_s=1.0, batch_size=32, optimizer="adamw")
    unmeasured = replace(base, layers=tuple(replace(x, saved_bytes=None) for x in base.layers))
    measured = replace(base, layers=tuple(replace(x, saved_bytes=128) for x in base.layers))
    assert profile_fingerprint(unmeasured) == profile_fingerprint(base)
    assert profile_fingerprint(measured) != profile_fingerprint(unmeasured)


def test_the_committed_optimizer_profiles_are_made_from_the_committed_base() -> None:
    """examples/convergence/results: every kept optimizer profile names its base's digest, so
    redrawing the report measures nothing again."""
    from pipeoptim.plan.profile import Profile
    from pipeoptim.study.targets import profile_fingerprint

    results = Path(__file__).parents[2] / "examples" / "convergence" / "results"
    kept = sorted(results.glob("*/profile-*.json"))
    assert kept
    for path in kept:
        base = Profile.load(path.parent / "profile.json")
        assert Profile.load(path).meta["base"] == profile_fingerprint(base), path


def test_a_kept_optimizer_profile_is_retimed_in_its_prediction_alone() -> None:
    """``retimed_predictions``: the mlp's units under Muon get a per-update setup where they
    hold a matrix (Newton–Schulz runs once per update) and a new per-write time; updates,
    state bytes and meta (its base) stay; a profile of another base is refused."""
    from pipeoptim.plan.profile import Profile
    from pipeoptim.study.targets import optimizer_profile, retimed_predictions

    base = Profile.uniform(9, forward_s=0.5, backward_s=1.0, batch_size=32, optimizer="adam")
    made = optimizer_profile(base, "mlp", "muon")
    old = replace(made, layers=tuple(replace(x, prediction_setup_s=None) for x in made.layers))
    new = retimed_predictions(old, base, "mlp", repeats=1)
    assert new.meta == old.meta
    for was, now in zip(old.layers, new.layers, strict=True):
        assert (now.update_s, now.optimizer_state_bytes) == (
            was.update_s,
            was.optimizer_state_bytes,
        )
    # the mlp's units alternate Linear (a matrix: Newton–Schulz) and ReLU (nothing kept)
    setups = [x.prediction_setup_s for x in new.layers]
    assert all(x is not None for x in setups[::2]) and setups[1::2] == [None] * 4
    other = Profile.uniform(9, forward_s=0.7, backward_s=1.0, batch_size=32, optimizer="adam")
    with pytest.raises(RuntimeConfigError, match="not made from this base profile"):
        retimed_predictions(old, other, "mlp", repeats=1)
