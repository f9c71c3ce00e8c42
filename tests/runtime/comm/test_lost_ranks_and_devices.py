"""What the ranks of a run do when a process they depend on dies, and a device the build
cannot have.

* A library run under torchrun whose torchrun is killed (``kill -9``) stops on every rank
  within a second or so, each with one line and no traceback, instead of training on as
  orphans.
* A ``pipeoptim train`` rank killed while the run starts (here: while its model is built,
  so the others wait in the Pipeline's first barrier) leaves the other ranks with one line
  each, not Python tracebacks, and the launcher names it.
* ``device="cuda:7"`` on a build without CUDA, or beyond the GPUs there are, is refused with
  the rule and the fix, not a raw ``AssertionError``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from pipeoptim.errors import PeerLostError, RuntimeConfigError
from pipeoptim.runtime.comm.placement import local_device, pick_device

ROOT = Path(__file__).resolve().parents[3]

LIBRARY_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    from pipeoptim import Pipeline

    class Batches:  # read by stage 0's rank: says once that it trains
        def __len__(self):
            return 64

        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for i in range(64):
                if i == 10 and not getattr(self, "said", False):
                    self.said = True
                    print("training: stage 0", flush=True)
                x = torch.randn(8, 6, generator=g)
                yield x, (x[:, 0] > 0).long()

    calls = []

    def loss(out, target):  # on the last stage's rank: says once that it trains
        calls.append(1)
        if len(calls) == 10:
            print("training: last stage", flush=True)
        return F.cross_entropy(out, target)

    torch.manual_seed(0)
    pipe = Pipeline(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)),
        method="pipeoptim",
        stages=2,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn=loss,
        transport="dist",
        device="cpu",
        timeout=600,
    )
    pipe.fit(Batches(), epochs=10**6)  # hours: it must be stopped
    """
)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which no one of ours reaps, counts as gone)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_a_library_run_stops_when_its_torchrun_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LIBRARY_SCRIPT)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    err_path, out_path = tmp_path / "err.log", tmp_path / "out.log"
    with err_path.open("w") as err, out_path.open("w") as out:
        agent = subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
                *("--master-addr", "127.0.0.1", "--master-port", str(port), str(script)),
            ],
            stdout=out,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        )
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 90
        # both ranks are training (each says so once, after 10 mini-batches)
        while time.monotonic() < deadline and out_path.read_text().count("training") < 2:
            assert agent.poll() is None, err_path.read_text()[-3000:]
            time.sleep(0.2)
        ranks = _children(agent.pid)
        assert len(ranks) == 2, f"the ranks did not start: {err_path.read_text()[-3000:]}"
        agent.send_signal(signal.SIGKILL)  # no one is left to stop the ranks
        agent.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 10 and any(_alive(r) for r in ranks):
            time.sleep(0.1)
        gone_after = time.monotonic() - killed
    finally:
        for r in _children(agent.pid) if agent.poll() is None else []:
            os.kill(r, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
    text = err_path.read_text()
    assert gone_after < 10, f"the ranks still trained {gone_after:.0f} s after torchrun died"
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if "torchrun (pid" in line]
    assert len(lines) == 2, text[-3000:]
    assert all("is gone; stopping" in line for line in lines)


def build_then_die() -> list[nn.Module]:
    """The model of the start-up test: in the rank named by $PIPEOPTIM_TEST_KILL_AT_BUILD
    the process kills itself (SIGKILL) while it builds the model, after the rendezvous,
    while the other ranks go on to the Pipeline's first barrier."""
    victim = os.environ.get("PIPEOPTIM_TEST_KILL_AT_BUILD")
    if victim is not None and victim == os.environ.get("RANK"):
        os.kill(os.getpid(), signal.SIGKILL)
    return [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)]


def dataset() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(140, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return x[:120], y[:120], x[120:], y[120:]


@pytest.mark.slow
def test_a_rank_killed_while_the_run_starts_leaves_one_line_per_rank() -> None:
    model = f"{Path(__file__).resolve()}:build_then_die"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pipeoptim", "train", "--quiet", "--transport", "dist"),
            *("--stages", "3", "--model", model, "--max-steps", "20", "--timeout", "30"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
            "PIPEOPTIM_TEST_KILL_AT_BUILD": "1",
        },
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(
        "pipeoptim train: error: rank 1 failed: was killed by signal SIGKILL"
    ), proc.stderr
    for rank in (0, 2):  # one line each, that says what happened to them
        mine = [line for line in lines if line.startswith(f"pipeoptim train: rank {rank}:")]
        assert len(mine) == 1 and "lost a peer rank" in mine[0], proc.stderr


def test_a_backend_report_of_a_closed_connection_is_a_lost_peer() -> None:
    from pipeoptim.runtime.comm.failure_board import lost_peer

    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:32672. This is typically caused by a remote worker crashing."
    )
    lost = lost_peer(gloo)
    assert isinstance(lost, PeerLostError) and lost.peer == -1
    assert str(lost) == (
        "lost a peer rank (it stopped or died): Connection closed by peer [127.0.0.1]:32672"
    )
    named = PeerLostError("lost rank 3", 3)
    assert lost_peer(named) is named
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert lost_peer(ValueError("Connection closed by peer")) is None


# -- 9. a device the build cannot have --------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only build, or no GPU visible")
@pytest.mark.parametrize("requested", ["cuda:7", "cuda:0", "cuda"])
def test_a_cuda_device_without_cuda_is_refused_with_the_fix(requested: str) -> None:
    with pytest.raises(RuntimeConfigError) as caught:
        pick_device(requested)
    message = str(caught.value)
    assert f"device {requested!r}" in message
    assert "use device 'cpu'" in message
    with pytest.raises(RuntimeConfigError):
        local_device(requested, None)


def test_a_gpu_index_beyond_the_gpus_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on a machine with 2 GPUs: cuda:7 is out of range, cuda:1 is fine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeConfigError) as caught:
        pick_device("cuda:7")
    message = str(caught.value)
    assert "device 'cuda:7'" in message and "2 GPU(s)" in message
    assert "cuda:0 to cuda:1" in message
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(RuntimeConfigError, match="unknown device 'cuda:x'"):
        pick_device("cuda:x")


def test_a_cpu_only_build_refuses_cuda_in_the_library_before_any_work() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from pipeoptim import Pipeline

    with pytest.raises(RuntimeConfigError, match="device 'cuda:7'"):
        Pipeline(
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
            method="gpipe",
            stages=2,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=nn.functional.cross_entropy,
            device="cuda:7",
        )


@pytest.mark.parametrize("transport", ["local", "dist"])
def test_pipeoptim_train_refuses_cuda_7_without_a_traceback(
    transport: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from pipeoptim.cli import main

    model = f"{Path(__file__).resolve()}:build_then_die"  # no victim: it just builds
    argv = ["train", "--quiet", "--device", "cuda:7", "--transport", transport]
    assert main([*argv, "--stages", "2", "--model", model, "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda:7'" in err and "use device 'cpu'" in err, err
    assert "Traceback" not in err and "AssertionError" not in err
    assert len(err.strip().splitlines()) == 1, err  # refused before any rank started
