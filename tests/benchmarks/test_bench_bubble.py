"""benchmarks/bench_bubble.py: the simulated bubbles of dualpipev, interleaved-zb and zb-v
against their published formulas (unit costs F = 1, B = 2, I = W = 1, F&B = F + B)."""

from __future__ import annotations

from typing import Any

from support import benchmark_scripts


def bench() -> Any:
    return benchmark_scripts.load("bench_bubble")


def test_bubbles_against_the_formulas() -> None:
    b = bench()
    found = {(row.method, row.ranks): row for row in b.rows()}
    for p in b.SIZES:
        # ZB1P's claim (P-1)(F+B-2W) = P-1 holds exactly for interleaved-zb and zb-v
        for method in ("interleaved-zb", "zb-v"):
            assert found[method, p].simulated == found[method, p].formula == p - 1
        # interleaved 1F1B: (P-1)(F+B) = 3(P-1), the baseline, exactly
        assert found["interleaved-1f1b", p].simulated == found["interleaved-1f1b", p].formula
        # DualPipeV: (P-1)(F&B+B-3W) = 2(P-1) with F&B run back to back; the schedule
        # idles P-1, what the formula gives with F&B = B (a forward hidden under a backward)
        row = found["dualpipev", p]
        assert row.formula == 2 * (p - 1) and row.simulated == p - 1
        # memory: 2P+1 stage-sized activations per rank (P + 1/2 of a rank's layers)
        assert row.activations == found["zb-v", p].activations == 2 * p + 1


def test_the_table_prints_every_row(capsys: Any) -> None:
    bench().main()
    out = capsys.readouterr().out
    assert out.count("| dualpipev |") == out.count("| interleaved-zb |") == 3
    assert "F&B = F + B = 3" in out
