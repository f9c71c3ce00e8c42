"""One rank of the varying-shapes runs, started by ``torchrun`` from
test_varying_shapes_dist.py.

First a transport check: rank 0 sends rank 1 tuples and tensors whose sizes only the
messages tell (``varying_shapes``), rank 1 posts every receive ahead and takes them out of
order, with a tag per message and with one tag (posting order). Then, for every method
named, the padded language model of ``support/varying_lm.py`` trains with a tag per message
and with one tag, evaluating between segments; each run's losses, evaluation losses and
final weights go to ``OUT/rank-R.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeoptim.runtime.comm.dist import DistTransport
from pipeoptim.runtime.comm.transport import RecvSpec
from support.varying_lm import padded_batches, padded_pipeline, weights

STEPS, EVAL_EVERY = 4, 2


def messages() -> list[tuple[tuple[str, int, int], Tensor | tuple[Tensor, ...]]]:
    g = torch.Generator().manual_seed(1)
    return [
        (("act", 1, 0), (torch.randn(2, 3, 5, generator=g), torch.arange(14).view(2, 7))),
        (("act", 1, 1), (torch.randn(2, 4, 5, generator=g), torch.arange(4).view(2, 2))),
        (("target", 1, 1), torch.arange(12).view(2, 6)),
        (("act", 1, 2), torch.randn(2, 9, generator=g)),
    ]


def spec_of(key: tuple[str, int, int], t: Tensor | tuple[Tensor, ...]) -> RecvSpec:
    """The receive rank 1 posts: per tensor, its rank and dtype, every size free (-1)."""
    if isinstance(t, Tensor):
        return key, 0, (2, -1), t.dtype
    return key, 0, tuple(((2, *(-1,) * (p.dim() - 1)), p.dtype) for p in t)


def transport_check(one_tag: bool) -> list[bool]:
    """Rank 1: whether each message arrived whole, taken in the order 3, 0, 2, 1."""
    transport = DistTransport(
        dist.get_rank(), 2, torch.device("cpu"), varying_shapes=True, one_tag=one_tag
    )
    sent = messages()
    if dist.get_rank() == 0:
        for key, t in sent:
            transport.send(t, 1, key)
        transport.flush()
        return []
    specs = [spec_of(key, t) for key, t in sent]
    transport.expect({0: specs})
    for spec in specs:  # posted ahead: headers only, and over one tag only the first
        if len(spec) == 4:
            transport.post_recv(*spec)
        else:
            transport.post_recv_parts(*spec)
    same = []
    for i in (3, 0, 2, 1):
        spec, (_, want) = specs[i], sent[i]
        got = transport.recv(*spec) if len(spec) == 4 else transport.recv_parts(*spec)
        if isinstance(want, Tensor):
            same.append(isinstance(got, Tensor) and torch.equal(got, want))
        else:
            same.append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
    return same


def run(method: str, one_tag: bool) -> dict[str, Any]:
    pipe = padded_pipeline(method, transport="dist", device="cpu", timeout=60, one_tag=one_tag)
    result = pipe.fit(
        padded_batches(STEPS),
        max_steps=STEPS,
        eval_data=padded_batches(2, seed=5),
        eval_every=EVAL_EVERY,
    )
    record = {
        "ordered": [t.needs_order for t in pipe.parts.transports.values()],
        "losses": result.losses,
        "evaluations": [e.loss for e in result.eval_history],
        "weights": weights(pipe),
    }
    pipe.close()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="1f1b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the Pipelines join it: one group for every run
    record: dict[str, Any] = {
        "transport": {tag: transport_check(tag == "one") for tag in ("each", "one")},
    }
    for method in args.methods.split(","):
        record[method] = {tag: run(method, tag == "one") for tag in ("each", "one")}
    torch.save(record, args.out / f"rank-{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
