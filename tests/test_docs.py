"""The design a docstring cites is in the repository, and the sections it names exist.

A reader of the package must be able to open what a docstring points at: the design lives
in ``docs/design.md``, and a citation names one of its sections, either by its anchor
(``docs/design.md#weight-version-semantics``) or by its title (``docs/design.md,
"Delay corrections"``). A renamed heading or a citation of a file outside the repository
fails here with the file, the line and what to change.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeoptim.plan.methods import METHODS
from pipeoptim.plan.versions import analyze_order

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SEARCHED = ("pipeoptim", "docs", "examples", "benchmarks", "tests", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".ini", ".html", ".rst", ".yaml", ".yml"}
OUTSIDE_DESIGN = "DESIGN" + ".md"  # spelled in two parts so that this file does not cite it

ANCHOR_CITATION = re.compile(r"design\.md#([\w-]+)")
TITLE_CITATION = re.compile(r"design\.md,?\s+\"([^\"]+)\"")
LOCAL_LINK = re.compile(r"\]\(#([\w-]+)\)")


def text_files() -> list[Path]:
    """Every text file of the searched folders (and the README), in a stable order."""
    found: list[Path] = []
    for name in SEARCHED:
        path = ROOT / name
        if path.is_file():
            found.append(path)
            continue
        found.extend(
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
        )
    return sorted(found)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def design_headings() -> dict[str, str]:
    """The design's section titles by their anchors."""
    titles = [
        line.lstrip("#").strip() for line in DESIGN.read_text().splitlines() if line.startswith("#")
    ]
    return {slug(title): title for title in titles}


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def test_the_design_is_in_the_repository_with_its_sections() -> None:
    headings = design_headings()
    for section in (
        "The plan",
        "Weight-version semantics",
        "The prediction distance",
        "Prediction per optimizer family",
        "Delay corrections",
        "Activation recomputation and weight versions",
        "Comparing asynchronous with synchronous training",
        "One Trace, two producers",
        "Layering",
    ):
        assert slug(section) in headings, f"docs/design.md lost its section {section!r}"


def test_no_file_cites_a_design_outside_the_repository() -> None:
    citing = []
    for path in text_files():
        text = path.read_text(errors="replace")
        for match in re.finditer(re.escape(OUTSIDE_DESIGN), text):
            citing.append(f"{path.relative_to(ROOT)}:{line_of(text, match.start())}")
    assert not citing, (
        f"{len(citing)} place(s) cite {OUTSIDE_DESIGN}, which is not in the repository: "
        f"{', '.join(citing)}; cite docs/design.md and its section instead "
        f'(docs/design.md, "Weight-version semantics")'
    )


@pytest.mark.parametrize("kind", ["anchor", "title", "local link"])
def test_every_cited_section_of_the_design_exists(kind: str) -> None:
    headings = design_headings()
    titles = {" ".join(title.split()) for title in headings.values()}
    missing = []
    for path in text_files():
        text = path.read_text(errors="replace")
        if kind == "anchor":
            cited = [
                (m, m.group(1), m.group(1) in headings) for m in ANCHOR_CITATION.finditer(text)
            ]
        elif kind == "title":
            cited = [
                (m, title, title in titles)
                for m in TITLE_CITATION.finditer(text)
                for title in [" ".join(m.group(1).split())]
            ]
        elif path == DESIGN:
            cited = [(m, m.group(1), m.group(1) in headings) for m in LOCAL_LINK.finditer(text)]
        else:
            cited = []
        missing.extend(
            f"{path.relative_to(ROOT)}:{line_of(text, m.start())} cites {name!r}"
            for m, name, found in cited
            if not found
        )
    assert not missing, (
        f"{len(missing)} citation(s) of docs/design.md name a section it does not have: "
        f"{'; '.join(missing)}; its sections are {sorted(headings)} (by anchor); cite one of "
        f"them, or restore the heading"
    )


def test_the_citation_patterns_find_what_they_are_meant_to() -> None:
    """The patterns above read citations across a docstring's line break."""
    cite = "docs/design" + ".md"  # in parts, so that the scan of this file does not read it
    docstring = '({cite}, "Activation\n    recomputation and weight versions")'
    text = f"see {cite}#delay-corrections and " + docstring.format(cite=cite)
    assert [m.group(1) for m in ANCHOR_CITATION.finditer(text)] == ["delay-corrections"]
    titles = [" ".join(m.group(1).split()) for m in TITLE_CITATION.finditer(text)]
    assert titles == ["Activation recomputation and weight versions"]
    assert slug("One Trace, two producers") == "one-trace-two-producers"


def design_table(first_header: str) -> dict[str, list[str]]:
    """The rows of the design's table whose header starts with ``first_header``: each method
    its first cell names (comma-separated) to the row's other cells."""
    rows: dict[str, list[str]] = {}
    inside = False
    for line in DESIGN.read_text().splitlines():
        if line.startswith(f"| {first_header} |"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.update({name: cells[1:] for name in cells[0].split(", ")})
    return rows


def test_the_weight_version_table_names_every_registered_method() -> None:
    rows = design_table("method | policy")
    assert sorted(rows) == sorted(METHODS), "docs/design.md's table and the registry differ"
    for name, cells in rows.items():
        assert cells[0] == METHODS[name].weight_policy.value.replace("-", " "), name


def test_the_derived_figures_of_the_design_are_the_version_analysis() -> None:
    rows = design_table("method | copies")
    assert sorted(rows) == sorted(n for n, m in METHODS.items() if not m.interleaved)
    for name, (copies, distance, staleness) in rows.items():
        method = METHODS[name]
        # each method at its default M (pipeoptim's dial: whole mini-batches)
        shape = method.shape(4, 4 if method.micro_batched_by_default else None, 16)
        report = analyze_order(
            method.order_arrays(shape), method.weight_policy, shape.micro_batches
        )
        stages = report.stages
        derived = (
            " ".join(str(report.weight_copies[k]) for k in stages),
            " ".join(str(report.max_distance(k)) for k in stages),
            " ".join(str(report.max_staleness(k)) for k in stages),
        )
        assert derived == (copies, distance, staleness), name
