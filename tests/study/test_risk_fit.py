"""The planner's risk tables against the committed convergence study: what the report's risk
part gives from the committed runs is the committed ``risk_fit.json`` and the package's
``risk_tables.json``, to the byte; ``run.py --report-only`` writes the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from pipeoptim.plan.risk_tables import packaged_path, risk_tables_json
from pipeoptim.study.risk_fit import risk_tables_from_fit, study_risk_fit

RUN = Path(__file__).resolve().parents[2] / "examples" / "convergence" / "run.py"


@pytest.fixture(scope="module")
def study_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convergence_run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def committed_fit(study_script: ModuleType) -> dict[str, object]:
    """The risk fit of the committed runs (no training, no profile, no figure)."""
    return study_risk_fit(study_script.RESULTS, study_script.STUDIES.values())


def test_the_committed_runs_give_the_committed_risk_fit(
    study_script: ModuleType, committed_fit: dict[str, object]
) -> None:
    text = (study_script.RESULTS / "risk_fit.json").read_text()
    assert json.dumps(committed_fit, indent=1) + "\n" == text


def test_the_package_tables_are_what_the_committed_study_gives(
    committed_fit: dict[str, object],
) -> None:
    """Every table (the metadata says all are derived) equals, to the byte, what the
    committed runs give: rerunning the study without ``--report-only``'s rewrite, or
    editing the file by hand, fails here."""
    derived = risk_tables_from_fit(committed_fit)
    assert derived.meta["not_derived"] == []
    assert risk_tables_json(derived) == packaged_path().read_text(encoding="utf-8")


def test_report_only_writes_the_package_tables(study_script: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "risk_tables.json"
    study_script.write_risk_tables(study_script.RESULTS, out)
    assert out.read_text(encoding="utf-8") == packaged_path().read_text(encoding="utf-8")
