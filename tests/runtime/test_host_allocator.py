"""The host allocator setting of a CPU run (``runtime/host_allocator.py``): each check runs in
a fresh process, since the setting is the process's and holds once made."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
from torch import nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.host_allocator import ENV_VARIABLES, MMAP_THRESHOLD, TRIM_THRESHOLD
from pipeoptim.runtime.pipeline import Pipeline


def glibc_here() -> bool:
    return platform.libc_ver()[0] == "glibc" and not any(v in os.environ for v in ENV_VARIABLES)


glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

# After the setting (or not), a 16 MiB tensor: glibc's default threshold (128 KiB, never yet
# raised in a fresh process) serves it with pages of its own; the tuned one from the heap.
PROBE = textwrap.dedent(
    """
    import ctypes, json, sys, torch
    from torch import nn
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    how = sys.argv[1]
    from pipeoptim.runtime import host_allocator
    if how == "call":
        host_allocator.keep_freed_memory()
    elif how.startswith("pipeline"):
        from pipeoptim.runtime.pipeline import Pipeline
        Pipeline([nn.Linear(4, 4), nn.Linear(4, 2)], "gpipe", stages=2, device="cpu",
                 tune_allocator=how == "pipeline")
    before = libc.mallinfo2().hblkhd
    big = torch.ones(4 << 20)
    mapped = libc.mallinfo2().hblkhd - before
    print(json.dumps({"mapped": mapped, "applied": host_allocator.applied()}))
    """
)


def probe(how: str, **env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if k not in ENV_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, how],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return dict(json.loads(out.stdout.splitlines()[-1]))


TUNED = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}


@glibc
def test_the_setting_keeps_a_large_block_on_the_heap() -> None:
    default, tuned = probe("none"), probe("call")
    assert default["applied"] == {} and int(default["mapped"]) >= 16 << 20  # type: ignore[call-overload]
    assert tuned["applied"] == TUNED and tuned["mapped"] == 0


@glibc
def test_a_pipeline_on_the_cpu_sets_it_unless_told_not_to() -> None:
    assert probe("pipeline") == {"mapped": 0, "applied": TUNED}
    untouched = probe("pipeline-untuned")
    assert untouched["applied"] == {} and int(untouched["mapped"]) >= 16 << 20  # type: ignore[call-overload]


@glibc
@pytest.mark.parametrize("variable", ENV_VARIABLES)
def test_a_threshold_the_user_set_stands(variable: str) -> None:
    assert probe("call", **{variable: str(64 << 10)})["applied"] == {}


def test_tune_allocator_takes_a_bool() -> None:
    with pytest.raises(RuntimeConfigError, match="tune_allocator must be True or False"):
        Pipeline([nn.Linear(4, 4), nn.Linear(4, 2)], "gpipe", stages=2, tune_allocator="yes")  # type: ignore[arg-type]


def test_the_trace_records_the_setting() -> None:
    import torch

    pipe = Pipeline([nn.Linear(4, 4), nn.Linear(4, 2)], "gpipe", stages=2, device="cpu")
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 2
    pipe.fit(data, max_steps=2)
    from pipeoptim.runtime import host_allocator

    meta = pipe.trace().meta
    expected = TUNED if glibc_here() else {}
    assert meta["host_allocator"] == host_allocator.applied() == expected
    json.dumps(meta["host_allocator"])
