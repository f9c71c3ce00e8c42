"""Property-based robustness of the ``pipeoptim`` command: no input ends in a traceback.

Random argument vectors go to every sub-command and random mutations of valid plan,
profile, trace and CSV files go to the commands that read them. Properties: the exit status
is 0 or 2, nothing prints a traceback, every example finishes in bounded time, and the
process stays under a memory ceiling; a few size-heavy vectors run in a subprocess under
``RLIMIT_AS``. Sizes are drawn small (fast) or absurd (refused at once by the work limits):
nothing in between, so the tests stay fast and deterministic (``derandomize=True``).

``pipeoptim profile`` (and ``plan --model``) measure a torch model; here the measurement is
replaced by a synthetic profile, so what is tested is the command around it.

To cover another sub-command: add its flags to ``COMMANDS`` with value strategies and a
test like :func:`test_fuzz_train_args`.
"""

from __future__ import annotations

import copy
import io
import json
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoptim.cli import main
from pipeoptim.commands import planning
from pipeoptim.plan.actions import schedule_to_csv
from pipeoptim.plan.graph import stage_graph, stage_graph_to_dict
from pipeoptim.plan.methods import METHODS, build_schedule
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace

SECONDS_PER_EXAMPLE = 20.0
"""Bound on one in-process example (the slowest legitimate ones take about a second)."""
MAX_RSS_BYTES = 3 << 30
"""Peak resident memory the test process may reach (high-water mark, checked per example)."""
RLIMIT_BYTES = 1 << 30
"""Address-space limit of the subprocess examples."""

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# --------------------------------------------------------------------------- running
@dataclass
class Result:
    argv: list[str]
    code: int
    out: str
    err: str
    seconds: float


def run_cli(argv: list[str]) -> Result:
    """``pipeoptim.cli.main(argv)`` in-process; argparse's exits become their status."""
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    return Result(argv, code, out.getvalue(), err.getvalue(), time.perf_counter() - start)


def assert_clean(result: Result) -> None:
    shown = f"argv={result.argv}\nstdout={result.out[-2000:]}\nstderr={result.err[-2000:]}"
    assert result.code in (0, 2), shown
    assert "Traceback" not in result.out + result.err, shown
    assert result.seconds < SECONDS_PER_EXAMPLE, shown
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    assert peak < MAX_RSS_BYTES, shown
    if result.code == 2 and result.err:
        assert "error" in result.err or "not written" in result.err, shown


def run_limited(argv: list[str], timeout: float = 60.0) -> Result:
    """``python -m pipeoptim argv`` under ``RLIMIT_AS`` and a timeout."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (RLIMIT_BYTES, RLIMIT_BYTES))

    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeoptim", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        check=False,
    )
    return Result(argv, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)


# --------------------------------------------------------------------------- files
def _synthetic_profile() -> Profile:
    return Profile.uniform(6, 0.01, 0.02, activation_bytes=1000, param_bytes=4000, batch_size=8)


def valid_documents() -> dict[str, Any]:
    """One small valid plan, profile, runtime-like trace (dicts) and CSV schedule (text)."""
    profile = _synthetic_profile()
    bounds = [(0, 3), (3, 6)]
    plan = Plan(
        "pipeoptim",
        2,
        mini_batches=4,
        optimizer=OptimizerSpec("adam", 1e-3, {"weight_decay": 0.01}),
        batch_size=8,
        boundaries=bounds,
        stage_graph=stage_graph_to_dict(stage_graph(profile, bounds)),
    )
    measured_plan = Plan("pipedream", 2, optimizer=OptimizerSpec("sgd", 0.1))
    costs = CostModel.uniform(2, 0.01, 0.02, 0.002, param_bytes=4096, activation_bytes=1024)
    trace = evaluate_trace("pipedream", measured_plan.shape(4), costs)
    trace.meta.update(source="runtime", plan=measured_plan.to_dict(), batch_size=8, mini_batches=4)
    schedule, _ = build_schedule("1f1b", 2, 2, 2)
    return {
        "plan": json.loads(json.dumps(plan.to_dict())),
        "profile": json.loads(profile.to_json()),
        "trace": json.loads(json.dumps(trace.to_dict())),
        "csv": schedule_to_csv(schedule),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Input and output paths the argument strategies pick from."""
    root = tmp_path_factory.mktemp("fuzz")
    docs = valid_documents()
    paths = {}
    for name in ("plan", "profile", "trace"):
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps(docs[name]))
    paths["csv"] = root / "schedule.csv"
    paths["csv"].write_text(docs["csv"])
    paths["binary"] = root / "binary.bin"
    paths["binary"].write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 8)
    paths["empty"] = root / "empty.json"
    paths["empty"].write_text("")
    paths["deep"] = root / "deep.json"
    paths["deep"].write_text("[" * 100_000 + "]" * 100_000)
    (root / "out").mkdir()
    return {name: str(p) for name, p in paths.items()} | {"root": str(root)}


@pytest.fixture(autouse=True)
def _no_torch_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """`profile` and `plan --model` measure a torch model: use a synthetic profile instead."""

    def fake(model: str, batch_size: int, *_: Any, **__: Any) -> Profile:
        if model not in ("mlp", "tiny"):
            raise planning.PlanError(f"unknown model {model!r}; choose mlp or tiny")
        return _synthetic_profile()

    monkeypatch.setattr(planning, "_profile_model", fake)


# --------------------------------------------------------------------------- argument values
_SMALL = st.integers(1, 6).map(str)
SIZES = st.one_of(
    _SMALL,
    _SMALL,
    _SMALL,
    st.sampled_from(["0", "-1", "10000000", "1000000000", "9223372036854775808", "x", "1.5"]),
)
"""Mostly small valid sizes; else refused ones: zero, negative, absurd, not a number."""
NUMBERS = st.one_of(
    st.sampled_from(["0", "0.001", "0.5", "1"]),
    st.sampled_from(["-1", "nan", "inf", "-inf", "1e308", "x", "1e-300"]),
)
METHOD_NAMES = st.sampled_from([*METHODS, "all", "auto", "gpipe,pipeoptim", "bogus", ""])
BYTES = st.sampled_from(["1GiB", "0", "128MiB", "-1", "x", "1e30", "25GB/s"])
BANDWIDTHS = st.sampled_from(["25GB/s", "100Gbps", "0", "-5GB/s", "x", "1e-300", "inf", "1GiB"])
JUNK = st.sampled_from(["--", "-x", "--bogus", "=", "@file", "-P"])


def input_paths(kinds: tuple[str, ...]) -> st.SearchStrategy[str]:
    """A key into ``files`` (resolved in the test): mostly valid inputs, else broken ones."""
    valid = st.sampled_from(kinds[:1])
    return st.one_of(
        valid, valid, st.sampled_from([*kinds, "binary", "empty", "deep", "missing", "root"])
    )


OUTPUT = st.one_of(
    st.sampled_from(["out-file", "out-file2"]),
    st.sampled_from(["out-file", "out-file2", "missing-folder", "root", "is-file", ""]),
)
"""Output path keys: a writable file, a missing folder, a folder, a path under a file."""


def _resolve(value: str, files: dict[str, str]) -> str:
    root = Path(files["root"])
    table = {
        "out-file": str(root / "out" / "result.json"),
        "out-file2": str(root / "out" / "result2.html"),
        "missing-folder": str(root / "nope" / "x.json"),
        "is-file": str(Path(files["csv"]) / "x.json"),
        "missing": str(root / "missing.json"),
        "root": files["root"],
    }
    if value.startswith("@path:"):
        key = value[len("@path:") :]
        return files.get(key, table.get(key, key))
    return value


def _path(strategy: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return strategy.map(lambda key: f"@path:{key}")


COMMANDS: dict[str, dict[str, st.SearchStrategy[str] | None]] = {
    "schedule": {
        "--method": METHOD_NAMES,
        "--stages": SIZES,
        "--micro-batches": SIZES,
        "--mini-batches": SIZES,
        "--virtual-stages": SIZES,
        "--format": st.sampled_from(["grid", "csv", "png"]),
        "--out": _path(OUTPUT),
        "--load": _path(input_paths(("csv", "plan"))),
        "--torch-compatible": None,
        "--json": None,
    },
    "methods": {"--json": None},
    "simulate": {
        "--method": METHOD_NAMES,
        "--stages": SIZES,
        "-M": SIZES,
        "-N": SIZES,
        "-v": SIZES,
        "--uniform": st.sampled_from(
            ["1,2", "0,0", "1,2,0.1", "-1,2", "x", "1e308,1e308", "nan,1"]
        ),
        "--profile": _path(input_paths(("profile",))),
        "--plan": _path(input_paths(("plan", "profile"))),
        "--batch-size": SIZES,
        "--optimizer": st.sampled_from(["sgd", "adam", "lion"]),
        "--param-bytes": BYTES,
        "--activation-bytes": BYTES,
        "--bandwidth": BANDWIDTHS,
        "--latency": NUMBERS,
        "--no-contention": None,
        "--jitter": NUMBERS,
        "--seed": SIZES,
        "--engine": st.sampled_from(["simpy", "fast", "gpu"]),
        "--html": _path(OUTPUT),
        "--trace": _path(OUTPUT),
        "--chrome-trace": _path(OUTPUT),
        "--json": None,
    },
    "plan": {
        "--profile": _path(input_paths(("profile",))),
        "--model": st.sampled_from(["mlp", "bogus"]),
        "--stages": SIZES,
        "--method": METHOD_NAMES,
        "--micro-batches": SIZES,
        "--virtual-stages": SIZES,
        "--memory-cap": BYTES,
        "--bandwidth": BANDWIDTHS,
        "--latency": NUMBERS,
        "--optimizer": st.sampled_from(["sgd", "adamw", "lion"]),
        "--lr": NUMBERS,
        "--batch-size": SIZES,
        "--out": _path(OUTPUT),
        "--html": _path(OUTPUT),
        "--json": None,
    },
    "profile": {
        "--model": st.sampled_from(["mlp", "tiny", "bogus", "os:path"]),
        "--batch-size": SIZES,
        "--optimizer": st.sampled_from(["sgd", "rmsprop", "lion"]),
        "--repeats": SIZES,
        "--device": st.sampled_from(["cpu", "cuda:7", "x"]),
        "--out": _path(OUTPUT),
        "--json": None,
    },
    "calibrate": {
        "--trace": _path(input_paths(("trace", "plan"))),
        "--html": _path(OUTPUT),
        "--out-trace": _path(OUTPUT),
        "--json": None,
    },
}
"""Each sub-command's flags and their value strategies (``None``: a flag without value).
``train`` is added below its own block."""

CORE = {
    "schedule": ["--method", "--stages"],
    "simulate": ["--stages"],
    "plan": ["--profile", "--stages"],
    "profile": ["--out"],
    "calibrate": ["--trace"],
}
"""Flags present nine times in ten, so most vectors get past the required arguments."""


@st.composite
def argv_for(draw: st.DrawFn, command: str) -> list[str]:
    flags = COMMANDS[command]
    core = [f for f in CORE.get(command, []) if draw(st.integers(0, 9)) > 0]
    others = sorted(set(flags) - set(core))
    chosen = core + draw(st.lists(st.sampled_from(others), max_size=6, unique=True))
    argv = [command]
    for flag in chosen:
        argv.append(flag)
        values = flags[flag]
        if values is not None:
            argv.append(draw(values))
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(1, len(argv))), draw(JUNK))
    return argv


def _fuzz(argv: list[str], files: dict[str, str]) -> None:
    assert_clean(run_cli([_resolve(a, files) for a in argv]))


# --------------------------------------------------------------------------- argument fuzz
@FUZZ
@given(argv=argv_for("schedule"))
def test_fuzz_schedule_args(argv: list[str], files: dict[str, str]) -> None:
    _fuzz(argv, files)


@FUZZ
@given(argv=argv_for("methods"))
def test_fuzz_methods_args(argv: list[str], files: dict[str, str]) -> None:
    _fuzz(argv, files)


@FUZZ
@given(argv=argv_for("simulate"))
def test_fuzz_simulate_args(argv: list[str], files: dict[str, str]) -> None:
    _fuzz(argv, files)


@FUZZ
@given(argv=argv_for("plan"))
def test_fuzz_plan_args(argv: list[str], files: dict[str, str]) -> None:
    _fuzz(argv, files)


@FUZZ
@given(argv=argv_for("profile"))
def test_fuzz_profile_args(argv: list[str], files: dict[str, str]) -> None:
    _fuzz(argv, files)


@FUZZ
@given(argv=argv_for("calibrate"))
def test_fuzz_calibrate_args(argv: list[str], files: dict[str, str]) -> None:
    _fuzz(argv, files)


COMMANDS["train"] = {
    "--method": METHOD_NAMES,
    "--stages": SIZES,
    "--micro-batches": SIZES,
    "--batch-size": st.one_of(st.sampled_from(["8", "16", "30"]), SIZES),
    "--epochs": SIZES,
    "--model": st.sampled_from(["mlp", "bogus", "os:path", "mlp:x"]),
    "--optimizer": st.sampled_from(["sgd", "adam", "adamw", "rmsprop", "lion"]),
    "--lr": NUMBERS,
    "--seed": SIZES,
    "--prediction-offset": st.sampled_from(["0", "1", "-5", "x"]),
    "--transport": st.sampled_from(["local", "carrier-pigeon"]),
    "--lr-schedule": st.sampled_from(["constant", "cosine", "warmup-cosine", "step", "x"]),
    "--warmup": SIZES,
    "--amp": st.sampled_from(["bf16", "fp16", "fp8"]),
    "--grad-clip": NUMBERS,
    "--extrapolation": NUMBERS,
    "--timeout": NUMBERS,
    "--checkpoint-dir": _path(OUTPUT),
    "--checkpoint-every": SIZES,
    "--keep-checkpoints": SIZES,
    "--resume": None,
    "--plan": _path(input_paths(("plan", "profile"))),
    "--trace": _path(OUTPUT),
    "--json": None,
}
"""``train`` stays in process on the CPU (no ``--transport dist``: spawning is covered by
tests/runtime); every vector ends with ``--max-steps 2``, so an accepted one trains two
mini-batches of the digits MLP."""


@settings(FUZZ, max_examples=60)
@given(argv=argv_for("train"))
def test_fuzz_train_args(argv: list[str], files: dict[str, str]) -> None:
    _fuzz([*argv, "--quiet", "--device", "cpu", "--max-steps", "2"], files)


# --------------------------------------------------------------------------- file mutations
JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 10),
        st.sampled_from([10**9, 10**12, -(10**9), 2**70]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=5),
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=5,
)


def _slots(doc: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) in a JSON document, the document's own keys included."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield doc, key
            yield from _slots(value)
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield doc, index
            yield from _slots(value)


NUMBERS_LIKE = st.one_of(
    st.integers(-2, 12),
    st.sampled_from([10**7, 10**9, 10**15, 2**63]),
    st.floats(-10.0, 1e6),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300]),
)
"""A number where a number was: gets past the type checks, into the values' rules."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@st.composite
def mutated_json(draw: st.DrawFn, doc: Any) -> Any:
    """``doc`` with one to three random edits: a number changed (half the time), a value
    replaced, a key deleted, a key added."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        slots = list(_slots(doc))
        numbers = [(c, k) for c, k in slots if _is_number(c[k])]
        if numbers and draw(st.booleans()):
            container, key = draw(st.sampled_from(numbers))
            container[key] = draw(NUMBERS_LIKE)
            continue
        container, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "replace":
            container[key] = draw(JSON_VALUES)
        elif action == "delete":
            del container[key]
        elif isinstance(container, dict):
            container[draw(st.text(max_size=6))] = draw(JSON_VALUES)
        else:
            container.append(draw(JSON_VALUES))
    return doc


@st.composite
def mutated_text(draw: st.DrawFn, text: str) -> str:
    """``text`` with random characters replaced, deleted or inserted."""
    chars = list(text)
    alphabet = st.sampled_from(list("0123456789FBUW,\n _SENDRCVI-x\x00é"))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(chars)))
        action = draw(st.sampled_from(["replace", "delete", "insert"]))
        if action == "insert" or at == len(chars):
            chars.insert(at, draw(alphabet))
        elif action == "delete":
            del chars[at]
        else:
            chars[at] = draw(alphabet)
    return "".join(chars)


DOCS = valid_documents()
READERS = {
    "plan": [["simulate", "--plan", "{}", "--engine", "fast"], ["simulate", "--plan", "{}"]],
    "profile": [
        ["simulate", "--profile", "{}", "--stages", "2", "--engine", "fast"],
        ["plan", "--profile", "{}", "--stages", "2"],
    ],
    "trace": [["calibrate", "--trace", "{}"]],
    "csv": [["schedule", "--load", "{}"]],
}


def _read_mutation(kind: str, text: str, tmp: Path) -> None:
    path = tmp / f"mutated-{kind}"
    path.write_text(text, encoding="utf-8")
    for template in READERS[kind]:
        assert_clean(run_cli([str(path) if a == "{}" else a for a in template]))


@pytest.mark.parametrize("kind", ["plan", "profile", "trace"])
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_fuzz_mutated_json_files(kind: str, data: st.DataObject, files: dict[str, str]) -> None:
    doc = data.draw(mutated_json(DOCS[kind]))
    _read_mutation(kind, json.dumps(doc), Path(files["root"]))


@FUZZ
@given(text=mutated_text(DOCS["csv"]))
def test_fuzz_mutated_csv_files(text: str, files: dict[str, str]) -> None:
    _read_mutation("csv", text, Path(files["root"]))


def test_valid_documents_are_accepted(files: dict[str, str]) -> None:
    """The mutations start from files every reader accepts (exit 0)."""
    for kind, templates in READERS.items():
        for template in templates:
            result = run_cli([files[kind] if a == "{}" else a for a in template])
            assert result.code == 0, (kind, result.err)


# --------------------------------------------------------------------------- under RLIMIT_AS
SIZE_HEAVY = [
    ["schedule", "--method", "pipeoptim", "--stages", "100000"],
    ["schedule", "--method", "gpipe", "--stages", "8", "--micro-batches", "1000000000"],
    ["simulate", "--stages", "4", "--mini-batches", "1000000000"],
    ["simulate", "--stages", "4", "--mini-batches", "1000000000", "--engine", "fast"],
    ["simulate", "--method", "interleaved-1f1b", "--stages", "4", "--virtual-stages", "10000000"],
    ["simulate", "--stages", "100000", "--method", "pipeoptim", "--engine", "fast"],
]


@pytest.mark.parametrize("argv", SIZE_HEAVY, ids=lambda a: " ".join(a[:5]))
def test_size_heavy_vectors_are_refused_under_rlimit(argv: list[str]) -> None:
    result = run_limited(argv)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err
    assert "the limit is" in result.err, result.err
    assert result.seconds < 30


@settings(FUZZ, max_examples=6)
@given(
    command=st.sampled_from(["schedule", "simulate"]),
    method=st.sampled_from(sorted(METHODS)),
    sizes=st.lists(st.sampled_from(["2", "3", "10000000", "1000000000"]), min_size=3, max_size=3),
)
def test_fuzz_sizes_in_a_subprocess_under_rlimit(
    command: str, method: str, sizes: list[str]
) -> None:
    stages, micro, mini = sizes
    argv = [command, "--method", method, "--stages", stages, "--mini-batches", mini]
    if METHODS[method].micro_batched:
        argv += ["--micro-batches", micro]
    result = run_limited(argv)
    assert result.code in (0, 2), result.err
    assert "Traceback" not in result.out + result.err
