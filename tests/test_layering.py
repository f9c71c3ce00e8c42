"""Layering, read from the source: plan/ below sim/ below planning/, plan/, sim/, planning/
and calibrate/ free of torch, the runtime free of the simulator and of the built-in
workloads, and no import cycle among pipeoptim's modules, counting the imports inside
functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "pipeoptim"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:``: imports for annotations only, never run."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports(path: Path, *, top_level_only: bool, run_time_only: bool = False) -> set[str]:
    """Every module an import statement of ``path`` names (``from a.b import c`` names ``a.b``
    and ``a.b.c``): at the top of the file only, or anywhere (imports inside functions too);
    ``run_time_only`` leaves out the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    skipped = _type_checking_nodes(tree) if run_time_only else set()
    found: set[str] = set()
    for node in nodes:
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def banned_imports(rules: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """(module, what it imports) for every module of a package in ``rules`` that imports,
    anywhere in the file (lazy imports count too), something the package may not."""
    return sorted(
        (name, target)
        for name, path in MODULES.items()
        for package, banned in rules.items()
        if _within(name, (package,))
        for target in imports(path, top_level_only=False)
        if _within(target, banned)
    )


def own_modules(name: str, *, top_level_only: bool) -> set[str]:
    """The pipeoptim modules module ``name`` imports at run time (not its own packages)."""
    found = set()
    for target in imports(MODULES[name], top_level_only=top_level_only, run_time_only=True):
        # "from pipeoptim.runtime import stage" names the module pipeoptim.runtime.stage.stage
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            found.add(target)
    return found


def module_graph(*, top_level_only: bool) -> nx.DiGraph:
    """Module -> module it imports, over pipeoptim's own modules."""
    graph = nx.DiGraph()
    for name in MODULES:
        graph.add_edges_from((name, t) for t in own_modules(name, top_level_only=top_level_only))
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return sorted(c for c in nx.simple_cycles(graph) if len(c) > 1)


def test_plan_and_sim_import_nothing_above_them_and_no_torch() -> None:
    above = (
        "pipeoptim.runtime",
        "pipeoptim.workloads",
        "pipeoptim.planner",
        "pipeoptim.device_search",
        "pipeoptim.planning",
        "pipeoptim.calibrate",
        "pipeoptim.study",
        "pipeoptim.viz",
        "pipeoptim.commands",
        "pipeoptim.cli",
        "torch",
    )
    assert banned_imports({"pipeoptim.plan": ("pipeoptim.sim", *above)}) == []
    assert banned_imports({"pipeoptim.sim": above}) == []


def test_runtime_imports_neither_the_simulator_nor_the_workloads() -> None:
    """The runtime executes plans; the simulator and the built-in workloads are its peers and
    clients (workloads import the runtime, never the other way; the calibration glue that
    needs both the runtime's traces and the simulator is ``pipeoptim.calibrate``)."""
    banned = (
        "pipeoptim.sim",
        "pipeoptim.workloads",
        "pipeoptim.calibrate",
        "pipeoptim.planner",
        "pipeoptim.device_search",
        "pipeoptim.planning",
        "pipeoptim.study",
        "pipeoptim.commands",
        "pipeoptim.cli",
    )
    assert banned_imports({"pipeoptim.runtime": banned}) == []


def test_planning_and_calibration_import_no_torch_and_nothing_above_them() -> None:
    """Plan search (planning/) and calibration (calibrate/) are torch-free libraries over
    plan/ and sim/: the commands, the demo and the workloads call them, never the other way;
    neither reads the runtime (calibration speaks the shared Trace)."""
    above = (
        "pipeoptim.runtime",
        "pipeoptim.workloads",
        "pipeoptim.study",
        "pipeoptim.viz",
        "pipeoptim.demo",
        "pipeoptim.commands",
        "pipeoptim.cli",
        "torch",
    )
    rules = {
        "pipeoptim.planning": (*above, "pipeoptim.calibrate", "pipeoptim.planner"),
        "pipeoptim.calibrate": (*above, "pipeoptim.planning", "pipeoptim.planner"),
    }
    assert banned_imports(rules) == []
    assert {"pipeoptim.planning.entry", "pipeoptim.calibrate.fit"} <= set(MODULES)


RUNTIME = "pipeoptim.runtime"
SUBPACKAGES = tuple(
    f"{RUNTIME}.{p.name}"
    for p in sorted((ROOT / "runtime").iterdir())
    if p.is_dir() and (p / "__init__.py").exists()
)
"""runtime/ by concern: stage/, optim/, comm/, checkpoint/, model/, profiling/."""
SPINE = tuple(
    f"{RUNTIME}.{m}"
    for m in (
        "launch",
        "pipeline",
        "fit_loop",
        "fit_evaluation",
        "fit_watch",
        "divergence",
        "probe",
        "result",
        "checkpoint_folder",
        "executor",
        "rank_messages",
        "pipeline_clip",
        "recorder",
        "rank_result",
        "boundary",
        "segments",
        "feed",
        "assembly",
    )
)
"""The runtime's spine, top down: launch -> the Pipeline front -> the fit loop (with its dry
run, its divergence words and its result) -> the checkpoint folder -> the executor (with its
messages, its clipping by the pipeline's norm, its trace recorder, a process's result and the
boundaries it allocates from; the segments it runs and the data it feeds) -> the assembly of
the built parts."""
STAGE = f"{RUNTIME}.stage.stage"
STAGE_PARTS = tuple(
    name
    for name in MODULES
    if _within(name, (f"{RUNTIME}.stage", f"{RUNTIME}.optim")) and name != STAGE
)
"""The parts a stage's forward and backward run over, one concern each (stage/), and its
update rule (optim/)."""
ABOVE_THE_STAGE = (STAGE, *SPINE)


def test_the_stage_parts_import_nothing_above_them() -> None:
    """The runtime's layers run one way: a stage's parts <- the stage <- the executor <- the
    fit loop and the checkpoint folder <- the Pipeline front. A part that reached up (the
    version store asking the stage, the update asking the Pipeline) would tie the concerns
    back together."""
    assert banned_imports(dict.fromkeys(STAGE_PARTS, ABOVE_THE_STAGE)) == []
    upward = {
        STAGE: SPINE,
        f"{RUNTIME}.executor": SPINE[: SPINE.index(f"{RUNTIME}.executor")],
        f"{RUNTIME}.fit_loop": (f"{RUNTIME}.pipeline", f"{RUNTIME}.launch"),
        f"{RUNTIME}.checkpoint_folder": SPINE[: SPINE.index(f"{RUNTIME}.checkpoint_folder")],
    }
    assert banned_imports(upward) == []
    assert all(name in MODULES for name in (*STAGE_PARTS, *ABOVE_THE_STAGE))
    assert len(STAGE_PARTS) >= 10


def test_the_subpackages_import_nothing_of_the_spine() -> None:
    """A concern's subpackage (a stage part, the update rule, a transport, a checkpoint
    format, the model's units, the profiler) is used by the spine and never reaches up
    into it, so each can be read, tested and replaced on its own."""
    assert banned_imports(dict.fromkeys(SUBPACKAGES, SPINE)) == []
    assert {s.rpartition(".")[2] for s in SUBPACKAGES} >= {
        "stage",
        "optim",
        "comm",
        "checkpoint",
        "model",
        "profiling",
    }


def _concern(name: str) -> str:
    """The subpackage a runtime module belongs to, "spine", or the module itself."""
    for package in SUBPACKAGES:
        if _within(name, (package,)):
            return package
    return "spine" if name in SPINE else name


def test_every_runtime_module_is_in_a_subpackage_on_the_spine_or_shared() -> None:
    """No module of runtime/ sits at its top unless it is on the spine or shared by several
    concerns (the subpackages and the spine): a module one concern uses belongs in it."""
    graph = module_graph(top_level_only=False)
    loose = []
    for name in MODULES:
        if name.count(".") != 2 or not name.startswith(RUNTIME + ".") or name in SPINE:
            continue
        if MODULES[name].name == "__init__.py":  # a subpackage
            continue
        users = {_concern(u) for u, _ in graph.in_edges(name) if _within(u, (RUNTIME,))}
        if len(users - {name}) < 2:
            loose.append((name, sorted(users)))
    assert loose == []


def test_the_file_reader_and_the_limits_are_leaves() -> None:
    """``jsonfile`` (which the plan reads its files through) and ``plan.limits`` (which every
    size check reads) import nothing from pipeoptim at run time but its errors, so no circle
    can close through either (the one that did: jsonfile -> plan.limits -> plan.methods ->
    plan.actions -> jsonfile)."""
    for leaf in ("pipeoptim.jsonfile", "pipeoptim.plan.limits"):
        assert own_modules(leaf, top_level_only=False) <= {"pipeoptim.errors"}, leaf


def test_no_import_cycle_between_modules() -> None:
    assert cycles(module_graph(top_level_only=True)) == []


def test_no_import_cycle_through_lazy_imports() -> None:
    """An import inside a function closes a circle as surely as one at the top, only later
    (e.g. commands.planning -> commands.plan_devices -> commands.planning). Imports under
    ``if TYPE_CHECKING:`` never run and are left out."""
    assert cycles(module_graph(top_level_only=False)) == []


def test_the_import_reader_sees_lazy_imports_and_skips_type_checking_ones(
    tmp_path: Path,
) -> None:
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from pipeoptim.a import g\n")
    assert imports(lazy, top_level_only=True) == set()
    assert imports(lazy, top_level_only=False) == {"pipeoptim.a", "pipeoptim.a.g"}
    typed = tmp_path / "typed.py"
    typed.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeoptim.a\n"
    )
    assert imports(typed, top_level_only=False, run_time_only=True) == {
        "typing",
        "typing.TYPE_CHECKING",
    }
    assert "pipeoptim.a" in imports(typed, top_level_only=False)


def test_the_architecture_map_names_every_package_and_module() -> None:
    """``docs/architecture.md`` is the map a newcomer reads (the README links it): every
    package and top-level module appears in its diagram, and every module of the runtime, its
    subpackages and the other packages in their rows of its table, so a new module cannot
    land unmapped; the README's front page shows the same diagram."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    diagram = doc.split("```", 2)[1]
    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    tops |= {p.stem for p in ROOT.glob("*.py") if not p.name.startswith("_")}
    assert sorted(t for t in tops if t not in diagram) == []
    readme = (ROOT.parent / "README.md").read_text()
    assert diagram.strip() in readme
    folders = [p for p in ROOT.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]
    mapped = ("runtime", "workloads", "plan", "sim", "study", "viz", "demo", "calibrate")
    rows = {line.split("`", 2)[1]: line for line in doc.splitlines() if line.startswith("| `")}
    checked = 0
    for folder in folders:
        name = str(folder.relative_to(ROOT)) + "/"
        if not name.startswith(mapped):
            continue
        assert name in rows, f"no row for {name} in docs/architecture.md"
        words = set(rows[name].replace("`", " ").replace("(", " ").replace(",", " ").split())
        modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
        assert [m for m in modules if m not in words] == [], name
        checked += 1
    assert checked >= 13
