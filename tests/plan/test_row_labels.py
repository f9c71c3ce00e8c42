"""The study's row labels with settings (issue 65): the dial's ``pipeoptim M=2 (muon)`` and
the extrapolation's ``xpipe+extrapolate λ=0.5``, read apart and written back, and the flags
the planner's advice prints for them."""

from __future__ import annotations

import pytest

from pipeoptim.plan import risk
from pipeoptim.plan.risk import StudyRow, parse_row, row_label, split_row


@pytest.mark.parametrize(
    ("label", "row"),
    [
        ("pipeoptim", StudyRow("pipeoptim", None)),
        ("pipeoptim (muon)", StudyRow("pipeoptim", "muon")),
        ("pipeoptim M=2 (muon)", StudyRow("pipeoptim", "muon", micro_batches=2)),
        ("pipeoptim M=16", StudyRow("pipeoptim", None, micro_batches=16)),
        ("xpipe+extrapolate λ=0.5", StudyRow("xpipe+extrapolate", None, extrapolation=0.5)),
        (
            "xpipe+extrapolate λ=0.25 (muon)",
            StudyRow("xpipe+extrapolate", "muon", extrapolation=0.25),
        ),
        ("pipeoptim+Ŵbackward", StudyRow("pipeoptim", None, predicted_backward=True)),
    ],
)
def test_a_label_reads_apart_and_writes_back(label: str, row: StudyRow) -> None:
    assert parse_row(label) == row
    written = row_label(
        row.method,
        row.optimizer,
        micro_batches=row.micro_batches,
        extrapolation=row.extrapolation,
        predicted_backward=row.predicted_backward,
    )
    assert written == label


def test_split_row_keeps_the_settings_with_the_name() -> None:
    assert split_row("pipeoptim M=2 (muon)") == ("pipeoptim M=2", "muon")
    assert split_row("xpipe+extrapolate λ=1") == ("xpipe+extrapolate λ=1", None)


def test_an_unknown_setting_names_no_method() -> None:
    assert parse_row("pipeoptim K=2").method == "pipeoptim K=2"
    assert risk._method_of("pipeoptim K=2") is None


def test_the_flags_a_user_types_for_a_row_with_settings() -> None:
    assert (
        risk._flags("pipeoptim M=2 (muon)")
        == "--method pipeoptim --micro-batches 2 --optimizer muon"
    )
    assert (
        risk._flags("xpipe+extrapolate λ=0.5 (muon)")
        == "--method xpipe+extrapolate --extrapolation 0.5 --optimizer muon"
    )
    assert risk._flags("pipeoptim") == "--method pipeoptim"
    assert risk._flags("pipeoptim+Ŵbackward") == (
        "--method pipeoptim, Pipeline(predicted_backward=True)"
    )


def test_a_dial_row_is_the_dial_methods_and_micro_batched_at_m_above_1() -> None:
    assert risk._method_of("pipeoptim M=2 (muon)") is risk.METHODS["pipeoptim"]
    assert risk._asynchronous("pipeoptim M=2 (muon)")
    assert risk._micro_batched("pipeoptim M=2 (muon)")
    assert not risk._micro_batched("pipeoptim M=1")
    assert not risk._micro_batched("pipeoptim (muon)")
    assert risk._micro_batched("xpipe (muon)")


def test_depth_advice_names_a_dial_row_with_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dial row that converged is micro-batched advice, with --micro-batches (by loss
    alone: a table without time)."""
    monkeypatch.setattr(risk, "DEPTH_SPEED", {})
    monkeypatch.setattr(risk, "DEPTH_EQUAL_TIME", {})
    monkeypatch.setattr(
        risk, "DEPTH_EXCESS", {8: {"pipeoptim (muon)": 0.06, "pipeoptim M=4 (muon)": 0.005}}
    )
    monkeypatch.setattr(
        risk, "DEPTH_COPIES", {8: {"pipeoptim (muon)": 2, "pipeoptim M=4 (muon)": 2}}
    )
    monkeypatch.setattr(risk, "DEPTH_EXCESS_FIRST", {})
    text = str(risk.depth_advice("pipeoptim", 8, "muon"))
    assert (
        "the best at this depth is micro-batched: pipeoptim M=4 (muon) came within 0.5 % with "
        "2 weight copies per stage (--method pipeoptim --micro-batches 4 --optimizer muon)"
    ) in text
