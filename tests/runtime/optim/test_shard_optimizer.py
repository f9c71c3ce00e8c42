"""Optimizer state sharded across a stage's D data-parallel replicas (ZeRO-1) over gloo.

One torchrun launch of ``shard_worker.py`` (D = 2 replicas x P = 2 stages) trains each
(method, optimizer) case unsharded and sharded; the sharded run must give the unsharded
run's losses and final weights (within a tolerance from float32's machine epsilon: the
per-parameter update and the gathered Ŵ are the same arithmetic, so in practice the same
bits) while each replica holds half of each stage's optimizer bytes. Checkpoints of sharded
runs resume exactly, read as the unsharded run's, and resume onto another D both ways.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from support import shard_worker
from support.launch import torchrun

from pipeoptim import Pipeline
from pipeoptim.cli import build_parser
from pipeoptim.commands.train import build_config
from pipeoptim.errors import PipeoptimError, RuntimeConfigError, StageError
from pipeoptim.runtime.checkpoint.recut import SavedCut
from pipeoptim.runtime.optim.sharded import shard_optimizer

pytestmark = pytest.mark.slow
WORKER = Path(shard_worker.__file__)
EPS = torch.finfo(torch.float32).eps
TOL = 16 * EPS
"""Relative tolerance of a sharded value against the unsharded one: a few float32 ulps."""


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs() <= TOL * b.abs().clamp(min=1.0)).all())


def same_losses(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= TOL * max(abs(y), 1.0) for x, y in zip(a, b, strict=True)
    )


def same_weights(a: dict[int, list[torch.Tensor]], b: dict[int, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(close(x, y) for x, y in zip(a[k], b[k], strict=True))
        for k in a
    )


def one_process(folder: Path, steps: int, resume: bool = False, stages: int = 2) -> Any:
    """The D = 1 run in this process (local transport), optionally checkpointing."""
    torch.set_num_threads(1)
    pipe = Pipeline(
        shard_worker.make_model(),
        method="pipeoptim",
        stages=stages,
        optimizer=shard_worker.make_optimizer("adam"),
        device="cpu",
        checkpoint_dir=str(folder),
        checkpoint_every=3,
    )
    return pipe.fit(shard_worker.make_data(), max_steps=steps, resume=resume)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's record of one launch, after a D = 1 checkpoint at step 6 was written
    here (two copies: one resumed sharded, one not)."""
    work = tmp_path_factory.mktemp("shard")
    one_process(work / "one" / "False", 6)
    shutil.copytree(work / "one" / "False", work / "one" / "True")
    records = torchrun(WORKER, work, "--from-one", str(work / "one"), nproc=4)
    for r in records:
        r["work"] = work
    return records


@pytest.mark.parametrize(("method", "family"), [(m, f) for m, f, _, _ in shard_worker.CASES])
def test_sharded_equals_unsharded_with_half_the_optimizer_bytes(
    ranks: list[dict[str, Any]], method: str, family: str
) -> None:
    for r in ranks:
        plain, sharded = r["cases"][(method, family)][False], r["cases"][(method, family)][True]
        assert len(plain["losses"]) == shard_worker.STEPS
        assert same_losses(sharded["losses"], plain["losses"]), (sharded, plain)
        assert same_weights(sharded["weights"], plain["weights"])
        # the model's two stages hold two equal layers each: ZeRO's split is exactly half
        # (of the optimizer's own state: a correction's kept tensors stay whole)
        for k, full in plain["optimizer_bytes"].items():
            kept = plain["correction_bytes"][k]
            assert kept == sharded["correction_bytes"][k]
            assert full - kept > 0
            assert (sharded["optimizer_bytes"][k] - kept) * 2 == full - kept, (k, sharded, full)
    # and the replicas agree with each other (each owns a different half)
    for stage in (0, 1):
        a, b = (r for r in ranks if stage in r["cases"][(method, family)][True]["weights"])
        assert a["replica"] != b["replica"]
        wa = a["cases"][(method, family)][True]["weights"][stage]
        wb = b["cases"][(method, family)][True]["weights"][stage]
        assert all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))


def test_sharded_checkpoints_resume_exactly_in_the_unsharded_format(
    ranks: list[dict[str, Any]],
) -> None:
    r = ranks[0]
    assert len(r["rest"]["losses"]) == 3  # resumed at step 6
    assert r["part"]["losses"] + r["rest"]["losses"] == r["whole"]["losses"]
    assert all(
        torch.equal(x, y)
        for k in r["whole"]["weights"]
        for x, y in zip(r["rest"]["weights"][k], r["whole"]["weights"][k], strict=True)
    )
    assert same_losses(r["whole"]["losses"], r["whole_unsharded"]["losses"])
    work: Path = r["work"]
    for step in (6, 9):
        for k in (0, 1):
            name = f"step-{step:08d}/stage-{k}.pt"
            if step == 6:
                a = torch.load(work / "two-to-one" / name, weights_only=True)["state"]
            else:
                a = torch.load(work / "whole" / name, weights_only=True)["state"]
            b = torch.load(work / "whole-unsharded" / name, weights_only=True)["state"]
            assert a["optimizer_class"] == b["optimizer_class"] == "Adam"
            assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
            sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
            assert sa.keys() == sb.keys() and len(sa) == 4
            for i in sa:
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert close(sa[i][key], sb[i][key]), (step, k, i, key)
            for key, tensor in a["module"].items():
                assert close(tensor, b["module"][key])


def test_resume_onto_another_replica_count(ranks: list[dict[str, Any]]) -> None:
    """Sharded D = 2 -> D = 1 (one process, unsharded), and D = 1 -> D = 2 sharded, which
    continues exactly as D = 1 -> D = 2 unsharded."""
    work: Path = ranks[0]["work"]
    resumed = one_process(work / "two-to-one", 9, resume=True)
    assert resumed.start_step == 6
    whole_one = one_process(work / "one-whole", 9)  # the same drains (checkpoints)
    # D = 2 and D = 1 sum the batch's gradient in another order: rounding apart
    assert resumed.losses == pytest.approx(whole_one.losses[6:], abs=1e-5)
    for r in ranks:
        plain, sharded = r["from_one"][False], r["from_one"][True]
        assert len(sharded["losses"]) == 3
        assert same_losses(sharded["losses"], plain["losses"])
        assert same_weights(sharded["weights"], plain["weights"])
    assert ranks[0]["from_one"][True]["losses"] == pytest.approx(whole_one.losses[6:], abs=1e-5)


def test_an_optimizer_that_cannot_be_sharded_is_refused_by_name(
    ranks: list[dict[str, Any]],
) -> None:
    message = ranks[0]["refused"]
    assert message is not None
    assert "MyAdam" in message and "shard_optimizer off" in message and "Adam" in message


def test_bad_input_says_what_to_fix() -> None:
    with pytest.raises(RuntimeConfigError, match="data_parallel is 1; use data_parallel 2"):
        Pipeline(shard_worker.make_model(), stages=2, device="cpu", shard_optimizer=True)
    with pytest.raises(RuntimeConfigError, match="must be True or False"):
        Pipeline(shard_worker.make_model(), stages=2, device="cpu", shard_optimizer="yes")  # type: ignore[arg-type]
    params = list(shard_worker.make_model().parameters())
    group = cast(dist.ProcessGroup, None)  # refused before any collective
    with pytest.raises(StageError, match=r"cannot shard .*MyAdam.*leave shard_optimizer off"):
        shard_optimizer(shard_worker.MyAdam(params, lr=0.1), group, stage=3)
    with pytest.raises(StageError, match=r"cannot shard torch.optim.sparse_adam.SparseAdam"):
        shard_optimizer(torch.optim.SparseAdam(params, lr=0.1), group, stage=0)
    used = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    used.step()
    with pytest.raises(StageError, match="already holding state"):
        shard_optimizer(used, group, stage=0)


def test_train_flag(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["train", "--stages", "2", "--shard-optimizer"])
    with pytest.raises(PipeoptimError, match=r"--shard-optimizer .* --data-parallel is 1"):
        build_config(args)
    args = parser.parse_args(
        ["train", "--stages", "2", "--data-parallel", "2", "--shard-optimizer"]
    )
    config = build_config(args)
    assert config.plan.shard_optimizer and config.plan.data_parallel == 2
    assert config.transport == "dist"
    args = parser.parse_args(["train", "--stages", "2", "--data-parallel", "2"])
    assert not build_config(args).plan.shard_optimizer


def test_a_sharded_checkpoint_resumes_at_another_depth_and_replica_count(
    ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    """P = 2, D = 2 sharded -> P = 1, D = 1: the state was gathered whole when written, so
    it re-cuts by unit like any other; weights and optimizer state at the resume point are
    the checkpoint's, bit for bit, and the run trains on."""
    work: Path = ranks[0]["work"]
    folder = tmp_path / "two-to-one-stage"
    shutil.copytree(work / "two-to-one", folder)
    for later in folder.glob("step-*"):
        if later.name != "step-00000006":
            shutil.rmtree(later)
    payloads = [
        torch.load(folder / f"step-00000006/stage-{k}.pt", weights_only=True) for k in (0, 1)
    ]
    (folder / "latest.json").write_text(
        json.dumps({k: v for k, v in payloads[0].items() if k not in ("state", "stage")})
    )
    saved = SavedCut({k: p["state"] for k, p in enumerate(payloads)}, payloads[0]["boundaries"])
    torch.set_num_threads(1)
    pipe = Pipeline(
        shard_worker.make_model(),
        method="pipeoptim",
        stages=1,
        optimizer=shard_worker.make_optimizer("adam"),
        device="cpu",
        checkpoint_dir=str(folder),
        checkpoint_every=3,
    )
    unmoved = pipe.fit(shard_worker.make_data(), max_steps=6, resume=True)
    assert unmoved.start_step == 6 and any("re-cut by unit" in n for n in unmoved.notes)
    now = SavedCut({0: pipe.stages[0].state_dict()}, pipe.parts.bounds)
    assert now.tensors.keys() == saved.tensors.keys()
    assert all(torch.equal(now.tensors[n], saved.tensors[n]) for n in now.tensors)
    assert now.params.keys() == saved.params.keys()
    for name, param in now.params.items():
        theirs = saved.params[name].state
        assert param.state.keys() == theirs.keys()
        assert all(torch.equal(param.state[key], theirs[key]) for key in theirs)
    resumed = pipe.fit(shard_worker.make_data(), max_steps=9)
    assert len(resumed.losses) == 3 and all(math.isfinite(x) for x in resumed.losses)
