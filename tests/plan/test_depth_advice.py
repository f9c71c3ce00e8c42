"""The advice at depth by time to target: an asynchronous configuration where the study
measured it faster than zb-h1 (a lower loss at equal time, or within 3 % of gpipe at equal
samples at a speed above zb-h1's), else the synchronous zb-h1; silent where the user's choice
is the recommendation. The tables are small literal ones."""

from __future__ import annotations

import pytest

from pipeoptim.plan import risk


@pytest.fixture
def tables(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, float]]:
    """Muon's rows at 8 stages: excess at equal samples, speed over zb-h1, equal time."""
    excess = {
        "gpipe (muon)": 0.0,
        "pipeoptim (muon)": 0.086,
        "pipeoptim M=4 (muon)": 0.008,
        "xpipe (muon)": 0.019,
        "2bw (muon)": 0.11,
        "pipedream (muon)": 0.01,  # 8 copies: never advice
        "xpipe": 0.006,  # AdamW's: not Muon's advice
    }
    speed = {
        "gpipe (muon)": 0.7,
        "pipeoptim (muon)": 1.23,
        "pipeoptim M=4 (muon)": 1.15,
        "xpipe (muon)": 1.07,
        "2bw (muon)": 1.08,
        "pipedream (muon)": 1.9,
        "xpipe": 1.3,
    }
    copies = {row: 2 for row in excess} | {"gpipe (muon)": 1, "pipedream (muon)": 8}
    monkeypatch.setattr(risk, "DEPTH_EXCESS", {8: excess})
    monkeypatch.setattr(risk, "DEPTH_SPEED", {8: speed})
    monkeypatch.setattr(risk, "DEPTH_EQUAL_TIME", {8: {}})
    monkeypatch.setattr(risk, "DEPTH_COPIES", {8: copies})
    monkeypatch.setattr(risk, "DEPTH_EXCESS_FIRST", {})
    return {"excess": excess, "speed": speed, "equal": risk.DEPTH_EQUAL_TIME[8]}


def test_without_equal_time_the_fastest_row_within_3_percent_is_advised(
    tables: dict[str, dict[str, float]],
) -> None:
    """pipeoptim (muon) ends 8.6 % over gpipe: the dial row within 3 % at 1.15x zb-h1's
    samples/s beats xpipe (1.07x); 2bw is faster still but 11 % over, pipedream keeps 8
    copies, AdamW's xpipe is another optimizer's."""
    assert risk.faster_to_target(8, "muon") == ["pipeoptim M=4 (muon)", "xpipe (muon)"]
    text = str(risk.depth_advice("pipeoptim", 8, "muon"))
    assert text.startswith(
        "pipeoptim (muon) at 8 stages: on the convergence study's language model at 8 stages"
    )
    assert (
        "it measured 1.23× zb-h1's samples/s, +8.6 % over gpipe's final loss at equal samples "
        "(every figure against zb-h1 and gpipe under muon)"
    ) in text
    assert (
        "an asynchronous configuration is faster per sample than zb-h1 and ended within 3 % of "
        "gpipe's loss at equal samples (its time to that loss not measured): pipeoptim M=4 "
        "(muon) (1.15× zb-h1's samples/s, +0.8 % over gpipe's final loss at equal samples; "
        "2 weight copies per stage; --method pipeoptim --micro-batches 4 --optimizer muon)"
    ) in text


def test_a_lower_loss_at_equal_time_comes_first(tables: dict[str, dict[str, float]]) -> None:
    """A row measured at equal time ranks by that loss, ahead of the speed rule; a row
    measured above zb-h1's loss at equal time is not advised even though fast and within
    3 % at equal samples."""
    tables["equal"]["xpipe (muon)"] = -0.021
    tables["equal"]["pipeoptim M=4 (muon)"] = 0.004
    assert risk.faster_to_target(8, "muon") == ["xpipe (muon)"]
    text = str(risk.depth_advice("pipeoptim", 8, "muon"))
    assert (
        "ends lower than zb-h1 in zb-h1's time: xpipe (muon) (1.07× zb-h1's samples/s, +1.9 % "
        "over gpipe's final loss at equal samples, -2.1 % against zb-h1's loss in zb-h1's "
        "time; 2 weight copies per stage; --method xpipe --optimizer muon)"
    ) in text


def test_a_synchronous_choice_hears_of_a_faster_asynchronous_one(
    tables: dict[str, dict[str, float]],
) -> None:
    """zb-h1 and 1f1b make gpipe's updates: the advice names the faster asynchronous row,
    from where gpipe under Muon trained (8 stages for a 12-stage pipeline)."""
    text = str(risk.depth_advice("zb-h1", 12, "muon"))
    assert "zb-h1 (muon) at 12 stages" in text and "at 8 stages" in text
    assert "zb-h1 is synchronous" in text
    assert "(its time to that loss not measured): pipeoptim M=4 (muon)" in text
    advised = str(risk.depth_advice("1f1b", 8, "muon"))
    assert "(its time to that loss not measured): pipeoptim M=4 (muon)" in advised
    assert risk.depth_advice("zb-h1", 4, "muon") is None  # nothing measured that shallow


def test_an_asynchronous_choice_that_converged_hears_of_a_faster_one(
    tables: dict[str, dict[str, float]],
) -> None:
    """xpipe (muon) came within 3 % and is faster than zb-h1, but the dial row is faster
    still: said; the dial row itself, picked by its flags, is the recommendation: silent."""
    text = str(risk.depth_advice("xpipe", 8, "muon"))
    assert "xpipe (muon) at 8 stages" in text and "1.07× zb-h1's samples/s" in text
    assert "(its time to that loss not measured): pipeoptim M=4 (muon)" in text
    assert risk.depth_advice("pipeoptim", 8, "muon", micro_batches=4) is None
    # pipeoptim's default M (1) is its plain row
    assert "pipeoptim (muon) at 8 stages" in str(risk.depth_advice("pipeoptim", 8, "muon", 1))


def test_nothing_faster_advises_zb_h1_with_the_closest_asynchronous_row(
    tables: dict[str, dict[str, float]],
) -> None:
    """No asynchronous row qualifies: zb-h1 under Muon, with the closest row's figures
    (equal time first where measured); a synchronous choice then hears nothing."""
    tables["speed"]["pipeoptim M=4 (muon)"] = 0.95  # slower than zb-h1
    tables["speed"]["xpipe (muon)"] = 0.99
    assert risk.faster_to_target(8, "muon") == []
    text = str(risk.depth_advice("pipeoptim", 8, "muon"))
    assert (
        "nothing asynchronous with at most 2 weight copies per stage reaches gpipe's loss "
        "sooner than zb-h1: the best at this depth is the synchronous zb-h1 (gpipe's updates "
        "with the smallest bubble; --method zb-h1 --optimizer muon); the closest asynchronous "
        "was pipeoptim M=4 (muon) (0.95× zb-h1's samples/s, +0.8 % over gpipe's final loss "
        "at equal samples; 2 weight copies per stage; --method pipeoptim --micro-batches 4 "
        "--optimizer muon)"
    ) in text
    tables["equal"]["2bw (muon)"] = 0.03
    assert "the closest asynchronous was 2bw (muon) (1.08× zb-h1's samples/s, +11.0 %" in str(
        risk.depth_advice("pipeoptim", 8, "muon")
    )
    assert risk.depth_advice("zb-h1", 8, "muon") is None
    assert risk.depth_advice("gpipe", 8, "muon") is None


def test_a_row_without_the_figure_its_rule_needs_is_skipped(
    tables: dict[str, dict[str, float]],
) -> None:
    """No speed, no advice by speed; a figure never measured is never printed."""
    del tables["speed"]["pipeoptim M=4 (muon)"]
    assert risk.faster_to_target(8, "muon") == ["xpipe (muon)"]
    del tables["speed"]["pipeoptim (muon)"]
    text = str(risk.depth_advice("pipeoptim", 8, "muon"))
    assert "it measured +8.6 % over gpipe's final loss at equal samples (every" in text
    assert "zb-h1's loss in zb-h1's time" not in text
    assert risk.depth_advice("pipeoptim", 8, "sgd") is None  # the study has no SGD rows


def test_a_configuration_the_study_did_not_train_hears_the_advice_without_its_own_figures(
    tables: dict[str, dict[str, float]],
) -> None:
    """pipeoptim at M = 2 has no row: the advice still names the faster configuration, from
    where gpipe under Muon trained, and prints no figure for the untrained row."""
    text = str(risk.depth_advice("pipeoptim", 8, "muon", micro_batches=2))
    assert text.startswith(
        "pipeoptim M=2 (muon) at 8 stages: the convergence study did not train it; "
    )
    assert "(its time to that loss not measured): pipeoptim M=4 (muon) (1.15×" in text
    assert text.count("× zb-h1's samples/s") == 1  # the recommendation's figures only
