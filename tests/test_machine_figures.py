"""Figures in the README and docs that depend on the machine say so (issue 33, item 16): a
time, a throughput, a time to target or a planner ranking was measured (or simulated on a
profile of) the 2-core CPU machine these docs were written on; on another machine, `pipeoptim
plan --optimizer muon` at 8 stages can rank zb-h1 first. Each paragraph, table row or code
line that gives such a figure names the machine, or says the figure is machine-dependent."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FIGURE = re.compile(
    r"\d[\d,.]*\s?(?:s|ms|min)\b(?! per)"  # a wall time (not a rate "per ...")
    r"|\d[\d,.]* samples/s"  # a throughput
    r"|\d[\d.]*× (?:gpipe|zb-h1)'s time"  # a time to target (simulated speeds)
    r"|ranks `[^`]+` first"  # a planner ranking
)
LABEL = re.compile(r"2-core|2 cores|machine-dependent|depend(?:s)? on the machine|uniform costs")


def _blocks(text: str) -> list[str]:
    """Paragraphs of prose and table rows, each on its own; a code block together with the
    paragraph that follows it (its caption: a command's verbatim output cannot be labelled)."""
    out: list[str] = []
    paragraph: list[str] = []
    code: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            code.append(line)
        elif line.startswith("|"):
            out.append(line)
        elif line.strip():
            paragraph.append(line)
            continue
        if paragraph:
            out.append(" ".join(code + paragraph))
            paragraph, code = [], []
    out.append(" ".join(code + paragraph))
    return out


def test_machine_dependent_figures_name_the_machine() -> None:
    unlabelled = [
        f"{path.name}: {block[:160]}"
        for path in DOCS
        for block in _blocks(path.read_text())
        if FIGURE.search(block) and not LABEL.search(block)
    ]
    assert not unlabelled, "\n".join(unlabelled)


def test_the_planner_ranking_under_muon_is_said_to_depend_on_the_machine() -> None:
    text = " ".join((ROOT / "docs" / "choosing-a-method.md").read_text().split())
    sentence = next(s for s in text.split(". ") if "`--optimizer muon` at 8 stages it ranks" in s)
    assert "machine-dependent" in sentence and "zb-h1" in sentence, sentence
