"""A model whose input embedding is its output projection (one Parameter on two stages), and
one rank of its test runs, started by ``torchrun`` from test_ties.py and test_meta_device.py.

``--mode tied`` trains it with ``Pipeline(..., transport="dist")`` and saves each stage's
weights and the losses to ``OUT/rank-R.pt``. ``--mode meta`` builds a wide model on the meta
device, caps the process's address space (RLIMIT_AS) below what the whole model needs to
train, checks that the cap bites (training the whole model here fails), then trains its own
stage under it.
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.runtime.model.units import ModelUnits

VOCAB, DIM, CONTEXT = 13, 8, 6


class Embed(nn.Module):
    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: Tensor) -> Tensor:
        return self.table(ids)


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.proj(x)) + x


class TiedHead(nn.Module):
    """Logits through the embedding's own weight (GPT-2's tied output projection)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.weight = table.weight  # the same Parameter

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()


def tied_units(seed: int = 0, vocab: int = VOCAB) -> list[nn.Module]:
    torch.manual_seed(seed)
    table = nn.Embedding(vocab, DIM)
    return [Embed(table), Mix(), Mix(), TiedHead(table)]


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps: int, batch: int = 8, vocab: int = VOCAB) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (steps, batch, CONTEXT + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02)


def tied_pipeline(
    method: str,
    stages: int = 2,
    micro: int | None = 2,
    units: list[nn.Module] | ModelUnits | None = None,
    **kwargs: Any,
) -> Pipeline:
    """The tied model (or ``units``) in one process, as the tests train it."""
    return Pipeline(
        tied_units() if units is None else units,
        method=method,
        stages=stages,
        micro_batches=micro,
        optimizer=adamw,
        loss_fn=token_loss,
        device="cpu",
        **kwargs,
    )


WIDE, WIDE_UNITS = 2048, 8


def wide_units() -> list[nn.Module]:
    """8 x Linear(2048, 2048): 128 MiB of float32 weights, 512 MiB to train under AdamW
    (weights, gradients, two moments); built on the meta device (no storage)."""
    with torch.device("meta"):
        return [nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh()) for _ in range(WIDE_UNITS)]


def init_wide(index: int, unit: nn.Module) -> None:
    for m in unit.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=WIDE**-0.5)
            nn.init.zeros_(m.bias)


def wide_adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def wide_data(steps: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [
        (torch.randn(4, WIDE, generator=g), torch.randn(4, WIDE, generator=g)) for _ in range(steps)
    ]


def training_bytes(units: list[nn.Module]) -> int:
    """Weights, gradients and AdamW's two moments of ``units``."""
    return 4 * sum(p.numel() * p.element_size() for u in units for p in u.parameters())


def address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("tied", "meta"), required=True)
    parser.add_argument("--method", default="gpipe")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--one-tag", action="store_true")  # every message under one tag
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    record: dict[str, object] = {}
    if args.mode == "tied":
        pipe = Pipeline(
            tied_units(vocab=args.vocab),
            method=args.method,
            stages=args.stages,
            micro_batches=args.micro_batches,
            optimizer=adamw,
            loss_fn=token_loss,
            transport="dist",
            device="cpu",
            timeout=60,
            data_parallel=args.data_parallel,
            one_tag=args.one_tag,
        )
        batch = 8 * args.data_parallel
        result = pipe.fit(batches(args.steps, batch, args.vocab), max_steps=args.steps)
    else:
        units = wide_units()
        full = training_bytes(units)
        torch.distributed.init_process_group("gloo")
        # torch loads its compiler stack (dynamo, sympy: about 70 MiB mapped) when the first
        # optimizer is built: load it before the baseline, so the cap bounds the model
        wide_adamw([nn.Parameter(torch.zeros(1))])
        # A cap on what this process may map: what it maps now plus 3/4 of the whole
        # model's training state; one stage needs half of it.
        cap = address_space() + full * 3 // 4
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        try:
            whole = [torch.empty(full // 4, dtype=torch.uint8) for _ in range(4)]
            del whole
            record["whole_fits"] = True
        except (MemoryError, RuntimeError):
            record["whole_fits"] = False
        record["cap_over_baseline"] = full * 3 // 4
        record["full_bytes"] = full
        pipe = Pipeline(
            units,
            method=args.method,
            stages=args.stages,
            micro_batches=args.micro_batches,
            optimizer=wide_adamw,
            loss_fn=F.mse_loss,
            transport="dist",
            device="cpu",
            timeout=60,
            init_weights=init_wide,
        )
        result = pipe.fit(wide_data(args.steps), max_steps=args.steps)
        record["unmaterialized"] = [
            i for i, u in enumerate(units) if any(p.is_meta for p in u.parameters())
        ]
    record["weights"] = {
        k: {n: t.detach().clone() for n, t in s.module.state_dict().items()}
        for k, s in pipe.stages.items()
    }
    record["losses"] = result.losses
    torch.save(record, args.out / f"rank-{torch.distributed.get_rank()}.pt")
    pipe.close()


if __name__ == "__main__":
    main()
