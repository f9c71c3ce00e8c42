"""One rank of the export under data parallelism of runtime/checkpoint/test_export_checks.py,
started by torchrun.

2 stages x 2 replicas fit dp_worker's model with a checkpoint folder and export after each of
three fits (replica 1 checked the folder before replica 0 had written the
fit's last checkpoint). Every rank then checks that the file holds its own stages' weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import dp_worker
import torch

from pipeoptim import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = Pipeline(
        dp_worker.make_model(),
        method="1f1b",
        stages=2,
        micro_batches=2,
        optimizer=dp_worker.make_optimizer("sgd"),
        transport="dist",
        device="cpu",
        timeout=60,
        data_parallel=2,
        checkpoint_dir=str(args.out / "ckpt"),
    )
    rank = torch.distributed.get_rank()
    for r in range(3):
        pipe.fit(dp_worker.make_data(), max_steps=2 * (r + 1))
        path = pipe.export(args.out / f"model-{r}.pt")
        model = dp_worker.make_model()
        model.load_state_dict(torch.load(path, weights_only=True), strict=True)
        for k, stage in pipe.stages.items():
            first = pipe.parts.bounds[k][0]
            for j, unit in enumerate(stage.module):
                for mine, exported in zip(
                    unit.parameters(), model[first + j].parameters(), strict=True
                ):
                    assert torch.equal(mine.detach(), exported), (rank, r, k, j)
        (args.out / f"ok-{rank}-{r}").write_text("ok")
    pipe.close()


if __name__ == "__main__":
    main()
