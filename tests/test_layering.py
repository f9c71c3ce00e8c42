"""Layering, read from the source: plan/ below sim/ below the planner, plan/ and sim/ free of
torch, and no import cycle among pipeoptim's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "pipeoptim"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def test_plan_and_sim_import_nothing_above_them_and_no_torch() -> None:
    above = {
        "pipeoptim.plan": (
            "pipeoptim.sim",
            "pipeoptim.runtime",
            "pipeoptim.planner",
            "pipeoptim.study",
            "pipeoptim.commands",
            "torch",
        ),
        "pipeoptim.sim": (
            "pipeoptim.runtime",
            "pipeoptim.planner",
            "pipeoptim.study",
            "pipeoptim.commands",
            "torch",
        ),
    }
    bad = [
        (name, target)
        for name, path in MODULES.items()
        for package, banned in above.items()
        if name == package or name.startswith(package + ".")
        for target in imports(path, top_level_only=False)  # lazy imports count too
        if target.startswith(banned)
    ]
    assert bad == []


def test_no_import_cycle_between_modules() -> None:
    graph = nx.DiGraph()
    for name, path in MODULES.items():
        for target in imports(path, top_level_only=True):
            # "from pipeoptim.runtime import stage" names the module pipeoptim.runtime.stage
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph.add_edge(name, target)
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert cycles == []
