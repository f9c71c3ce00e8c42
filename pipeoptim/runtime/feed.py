"""How a user's batches enter the pipeline: read in order, checked, split into micro-batches.

Only the rank that holds stage 0 reads the data. It gives each micro-batch's inputs to
stage 0 and sends its targets to the rank of the last stage (one small extra message per
micro-batch, the size of the targets: for classification B/M integers, for a language model
B/M x T of them, both tiny next to the activations), with the whole mini-batch's count of
counted targets as the message's second tensor (:meth:`TrainFeed.counted`: the last stage
weighs each micro-batch's loss by its share of it). No other rank touches the data, so a
``DataLoader`` with workers runs once, not once per rank, and the ranks cannot disagree about
what a batch holds.

Any iterable of ``(input, target)`` tensor pairs works; the input may be a tuple (or list) of
tensors of one batch length, ``((ids, mask), target)``, which stage 0's first unit takes as
its positional arguments, or a dict of tensors (and None), ``({"input_ids": ids,
"attention_mask": mask}, labels)``, which stage 0's first unit takes as one argument; each
is split into micro-batches along its batch dimension. Every training batch must have the
same shape (receiving ranks allocate fixed buffers): the partial last batch a ``DataLoader``
yields without ``drop_last`` is left out of the epoch and counted, other odd batches are
refused with the fix. Exact resume: before each epoch the order is re-seeded from
``(seed, epoch)`` (``set_epoch`` where the data has it, the loader's and sampler's
generators, and the global RNG a shuffling ``DataLoader`` draws its seed from), and a
resumed run skips to its position by reading past the batches already trained on.

Where more than one rank reads the data (the last stage's rank under ``targets="read"``, the
stage-0 rank of each data-parallel replica), they must read the same batches. Once per fit
they compare a :class:`DataFingerprint` of the first batch and the epoch's length, and refuse
when those differ (a rank-dependent order; a ``DistributedSampler``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.replicas import check_batch_split
from pipeoptim.runtime.boundary import VARIES, shape_fits
from pipeoptim.runtime.payload import Payload, batch_len, describe, parts, split, to_device
from pipeoptim.runtime.stage.loss import counted_targets

__all__ = [
    "BatchSpec",
    "DataFingerprint",
    "EvalReader",
    "TrainFeed",
    "epoch_seed",
    "readers_disagree",
    "steps_per_epoch",
]


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s data order (the built-in loaders use the same one)."""
    return seed * 1_000_003 + epoch


@dataclass(frozen=True)
class BatchSpec:
    """What every batch of a run looks like: samples, and per-sample shapes and dtypes."""

    batch_size: int
    input_shape: tuple[int, ...] | tuple[tuple[int, ...], ...]
    """Per sample; for a tuple input, per tensor."""
    input_dtype: torch.dtype | tuple[torch.dtype, ...]
    target_shape: tuple[int, ...]
    target_dtype: torch.dtype

    def varying(self) -> BatchSpec:
        """This spec with every per-sample dimension free (``CommOptions.varying_shapes``):
        batches must keep their ranks and dtypes only."""

        def free(shape: tuple[int, ...]) -> tuple[int, ...]:
            return (VARIES,) * len(shape)

        x = self.input_shape
        if x and isinstance(x[0], tuple):
            inputs: tuple[int, ...] | tuple[tuple[int, ...], ...] = tuple(free(p) for p in x)
        else:
            inputs = free(x)  # type: ignore[arg-type]
        return replace(self, input_shape=inputs, target_shape=free(self.target_shape))

    @classmethod
    def of(cls, x: Payload, y: Tensor) -> BatchSpec:
        if isinstance(x, Tensor):
            return cls(len(x), tuple(x.shape[1:]), x.dtype, tuple(y.shape[1:]), y.dtype)
        shapes = tuple(tuple(t.shape[1:]) for t in parts(x))
        dtypes = tuple(t.dtype for t in parts(x))
        return cls(batch_len(x), shapes, dtypes, tuple(y.shape[1:]), y.dtype)

    def check(self, x: Payload, y: Tensor, where: str, *, any_size: bool = False) -> None:
        """Refuse a batch that differs from this spec in anything but (with ``any_size``)
        its sample count."""
        got = BatchSpec.of(x, y)
        if not any_size and got.batch_size != self.batch_size:
            raise RuntimeConfigError(
                f"{where} has {got.batch_size} samples but the first batch had "
                f"{self.batch_size}: every training batch must have the same size (the "
                f"receiving ranks allocate fixed buffers); use DataLoader(..., drop_last=True)"
            )
        for name, a, b in (
            ("inputs", (got.input_shape, got.input_dtype), (self.input_shape, self.input_dtype)),
            (
                "targets",
                (got.target_shape, got.target_dtype),
                (self.target_shape, self.target_dtype),
            ),
        ):
            if a[1] != b[1] or not _shapes_fit(a[0], b[0]):
                raise RuntimeConfigError(
                    f"{where} has {name} of per-sample shape {a[0]} and dtype {a[1]}, but the "
                    f"first batch had {b[0]} and {b[1]}: every batch must match (pad "
                    f"sequences to one length, or turn varying shapes on: varying_shapes="
                    f"True (Pipeline or CommOptions), where a collate pads each batch to its "
                    f"own longest sequence)"
                )


def _shapes_fit(got: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    """Per-sample shapes (of one tensor, or of each of a tuple's) that fit ``want``."""
    if want and isinstance(want[0], tuple):
        return len(got) == len(want) and all(
            isinstance(g, tuple) and shape_fits(g, w) for g, w in zip(got, want, strict=False)
        )
    return not (got and isinstance(got[0], tuple)) and shape_fits(got, want)


def _digest(t: Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(flat.numpy().tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class DataFingerprint:
    """What two readers of the same data must agree on, cheaply: the epoch's length, the
    first batch's shapes and dtypes, and a hash of its targets. Computed once per fit, from
    the batch the run starts with. The inputs are not compared: a random augmentation may
    draw them differently on two ranks, which is harmless (the last stage's rank uses only
    the targets; each replica trains on its own share), while other samples or another order
    shows in the targets."""

    steps_per_epoch: int
    skipped: int
    shapes: str
    targets: str
    sampler: str | None = None
    """The per-rank sampler the data draws from (``DistributedSampler``), named in the
    refusal; not compared."""

    @classmethod
    def of(
        cls, x: Payload, y: Tensor, steps_per_epoch: int, skipped: int, data: Any = None
    ) -> DataFingerprint:
        shapes = f"inputs {describe(x)}, targets {tuple(y.shape)} {y.dtype}"
        return cls(steps_per_epoch, skipped, shapes, _digest(y), _rank_sampler(data))

    def differences(self, other: DataFingerprint) -> list[str]:
        """What differs from ``other``, in words (empty: they agree)."""
        out = []
        if self.steps_per_epoch != other.steps_per_epoch:
            out.append(
                f"epoch length {self.steps_per_epoch} against {other.steps_per_epoch} batches"
            )
        elif self.skipped != other.skipped:
            out.append(f"{self.skipped} against {other.skipped} samples left out per epoch")
        if self.shapes != other.shapes:
            out.append(f"the first batch's shapes differ ({self.shapes} against {other.shapes})")
        elif self.targets != other.targets:
            out.append("the first batch's targets differ")
        return out


def _rank_sampler(data: Any) -> str | None:
    if isinstance(data, DataLoader):
        for sampler in (data.sampler, getattr(data.batch_sampler, "sampler", None)):
            if isinstance(sampler, DistributedSampler):
                return type(sampler).__name__
    return None


def readers_disagree(
    seen: list[tuple[DataFingerprint, DataFingerprint | str | None]], ranks: tuple[int, int, int]
) -> str | None:
    """Why the readers of a run must not train (None: they agree). ``seen``: per replica,
    the fingerprints of stage 0's rank and of the last stage's rank (None: it does not read;
    a string: its reading failed so); ``ranks``: P and the pipeline ranks of stage 0 and of
    the last stage."""
    p, first, last = ranks
    d = len(seen)
    for replica, (ours, theirs) in enumerate(seen):
        if isinstance(theirs, str):
            where = f"global rank {replica * p + last}"
            return f"the last stage's rank ({where}) failed reading the data: {theirs}"
        if theirs is None or not (diff := ours.differences(theirs)):
            continue
        hint = (
            f" (the data's {ours.sampler} gives every rank other samples)" if ours.sampler else ""
        )
        return (
            f"targets='read' needs the last stage's rank to read the same batches as stage "
            f"0's rank, but global ranks {replica * p + first} and {replica * p + last} read "
            f"different data: {'; '.join(diff)}{hint}. The last stage would train on targets "
            f"that do not belong to its inputs. Fix: make the data yield the same batches on "
            f"every rank (a DataLoader, shuffled or not, does under pipeoptim's per-epoch "
            f"seeding; no per-rank sampler, seed or stream), or use targets='send' (stage 0's "
            f"rank sends the targets)"
        )
    ref = seen[0][0]
    for replica, (ours, _) in enumerate(seen[1:], 1):
        if not (diff := ref.differences(ours)):
            continue
        sampler = ref.sampler or ours.sampler
        cause = (
            f"the data's {sampler} does that"
            if sampler
            else "a DistributedSampler is the likely cause"
        )
        return (
            f"each of the {d} data-parallel replicas must read the same data, whole, but "
            f"replica {replica} read other data than replica 0 (global ranks "
            f"{replica * p + first} and {first}): {'; '.join(diff)}. pipeoptim already gives "
            f"each replica its own 1/{d} of every batch, so data sharded per rank is sharded "
            f"twice and an epoch trains on part of it ({cause}). Fix: give every replica "
            f"the same data (no DistributedSampler; the same seed and order on every rank); "
            f"pipeoptim splits each batch itself"
        )
    return None


def as_batch(item: Any, where: str) -> tuple[Payload, Tensor]:
    """``item`` as an ``(input, target)`` pair of tensors with one batch dimension; the
    input may be a tuple or list of such tensors (returned as a tuple)."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        kind = f"a {type(item).__name__}" + (
            f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""
        )
        raise RuntimeConfigError(
            f"{where} is {kind}; the data must yield (input, target) pairs, e.g. a "
            f"DataLoader over a TensorDataset(inputs, targets)"
        )
    x, y = item
    if isinstance(x, (tuple, list)):
        return _tuple_input(x, y, where), y
    if isinstance(x, dict):
        return _mapping_input(x, y, where), y
    for name, t in (("input", x), ("target", y)):
        if not isinstance(t, Tensor):
            raise RuntimeConfigError(
                f"{where}: the {name} is a {type(t).__name__}, not a torch.Tensor; convert it "
                f"(torch.as_tensor) in the dataset or a collate_fn"
            )
        if t.dim() == 0:
            raise RuntimeConfigError(
                f"{where}: the {name} is a scalar tensor; batches need a leading batch dimension"
            )
    if len(x) != len(y):
        raise RuntimeConfigError(
            f"{where}: {len(x)} inputs but {len(y)} targets; give one target per sample"
        )
    return x, y


def _tuple_input(x: tuple[Any, ...] | list[Any], y: Any, where: str) -> tuple[Tensor, ...]:
    """A tuple (or a collated list) of input tensors, checked as :func:`as_batch` checks one."""
    if not x:
        raise RuntimeConfigError(f"{where}: the input is an empty {type(x).__name__}")
    for i, t in enumerate(x):
        if not isinstance(t, Tensor):
            raise RuntimeConfigError(
                f"{where}: input {i} of the input tuple is a {type(t).__name__}, not a "
                f"torch.Tensor; every tensor of a tuple input must be a tensor (convert it "
                f"with torch.as_tensor in the dataset or a collate_fn)"
            )
        if t.dim() == 0:
            raise RuntimeConfigError(
                f"{where}: input {i} of the input tuple is a scalar tensor; batches need a "
                f"leading batch dimension"
            )
    if not isinstance(y, Tensor) or y.dim() == 0:
        what = "a scalar tensor" if isinstance(y, Tensor) else f"a {type(y).__name__}"
        raise RuntimeConfigError(
            f"{where}: the target is {what}; give a tensor with a leading batch dimension"
        )
    lengths = [len(t) for t in x]
    if any(n != len(y) for n in lengths):
        raise RuntimeConfigError(
            f"{where}: the input tensors have {lengths} samples and the targets {len(y)}; "
            f"every tensor of a tuple input has the batch dimension first, one sample per target"
        )
    return tuple(x)


def _mapping_input(x: dict[Any, Any], y: Any, where: str) -> dict[str, Tensor | None]:
    """A dict input (``{"input_ids": ..., "attention_mask": ...}``), checked as
    :func:`as_batch` checks a tuple: tensors (or None) under string keys, one batch length."""
    values = [v for v in x.values() if v is not None]
    if not values:
        raise RuntimeConfigError(f"{where}: the input is a dict without a tensor")
    for k, v in x.items():
        if not isinstance(k, str) or (v is not None and not isinstance(v, Tensor)):
            what = f"the key {k!r}" if not isinstance(k, str) else f"its value {k!r}"
            raise RuntimeConfigError(
                f"{where}: the input dict's {what} is a {type(v).__name__}, which cannot enter "
                f"the pipeline: every value of a dict input is a tensor with the batch first, "
                f"or None, under a string key (convert it with torch.as_tensor in the "
                f"collate_fn, or leave it out of the batch)"
            )
    _tuple_input(values, y, where)  # the same checks, per tensor
    return dict(x)


def steps_per_epoch(data: Iterable[Any], given: int | None) -> tuple[int, int]:
    """Full batches per epoch, and samples per epoch left out (a partial last batch).

    The count must be known before training: a never-flushed pipeline is laid out for its
    whole length in advance.
    """
    if given is not None:
        if given < 1:
            raise RuntimeConfigError(f"steps_per_epoch must be at least 1 (got {given})")
        return given, 0
    if isinstance(data, DataLoader) and data.batch_size is not None:
        dataset: Any = data.dataset
        if hasattr(dataset, "__len__") and not data.drop_last:
            full, rest = divmod(len(dataset), data.batch_size)
            if full == 0:
                raise RuntimeConfigError(
                    f"the DataLoader holds {len(dataset)} samples, fewer than one batch of "
                    f"{data.batch_size}; lower batch_size"
                )
            return full, rest
    if not hasattr(data, "__len__"):
        raise RuntimeConfigError(
            f"the training data ({type(data).__name__}) has no len(), and a never-flushed "
            f"pipeline is laid out for its whole length in advance; pass "
            f"fit(..., steps_per_epoch=N)"
        )
    n = len(data)  # type: ignore[arg-type]
    if n < 1:
        raise RuntimeConfigError(
            "the training data is empty (len() is 0); give it at least one batch"
        )
    return n, 0


def iterate_epoch(data: Iterable[Any], seed: int, epoch: int) -> Iterator[Any]:
    """Iterate ``data`` for ``epoch`` with its order fixed by ``(seed, epoch)``."""
    s = epoch_seed(seed, epoch)
    set_epoch = getattr(data, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    if isinstance(data, DataLoader):
        samplers = {data.sampler, getattr(data.batch_sampler, "sampler", None)}
        for sampler in samplers:
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)  # type: ignore[union-attr]
            gen = getattr(sampler, "generator", None)
            if isinstance(gen, torch.Generator):
                gen.manual_seed(s)
        if isinstance(data.generator, torch.Generator):
            data.generator.manual_seed(s)
    # A shuffling DataLoader draws its seed from the global RNG when the first batch is
    # asked for; fork so the draw is reproducible and the caller's RNG is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s)
        it = iter(data)
        first = next(it, _END)
    return iter(()) if first is _END else itertools.chain([first], it)


_END = object()


class TrainFeed:
    """Stage 0's rank: the micro-batches of global step ``g``, read in step order. Under
    data parallelism (``replicas`` > 1) each batch is the global one and this replica trains
    on its ``replica``-th contiguous 1/D of it."""

    def __init__(
        self,
        data: Iterable[Any],
        *,
        steps_per_epoch: int,
        micro_batches: int,
        device: torch.device,
        seed: int,
        start_step: int,
        replicas: int = 1,
        replica: int = 0,
        varying_shapes: bool = False,
    ) -> None:
        self.data = data
        self.varying_shapes = varying_shapes
        """Batches may differ in their per-sample sizes (``CommOptions.varying_shapes``)."""
        self.steps_per_epoch = steps_per_epoch
        self.micro_batches = micro_batches
        self.replicas, self.replica = replicas, replica
        self.device = device
        self.seed = seed
        self.spec: BatchSpec | None = None
        self._epoch = start_step // steps_per_epoch
        self._it = iterate_epoch(data, seed, self._epoch)
        self._pos = 0
        self._next = start_step  # the step the next batch read belongs to
        self._peeked: tuple[Payload, Tensor] | None = None
        for _ in range(start_step % steps_per_epoch):  # resume: skip what was trained on
            self._read()
        self._step = -1
        self._parts: tuple[list[Payload], tuple[Tensor, ...]] = ([], ())
        self._counted = torch.zeros(1, dtype=torch.int64)
        self._counted_host: int | None = None

    def peek(self) -> tuple[Payload, Tensor]:
        """The next batch, not consumed (the run's first batch fixes the BatchSpec)."""
        if self._peeked is None:
            self._peeked = self._read()
        return self._peeked

    def _read(self) -> tuple[Payload, Tensor]:
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return batch
        if self._pos == self.steps_per_epoch:
            self._epoch += 1
            self._it, self._pos = iterate_epoch(self.data, self.seed, self._epoch), 0
        where = f"batch {self._pos} of epoch {self._epoch}"
        item = next(self._it, _END)
        if item is _END:
            raise RuntimeConfigError(
                f"the training data ended after {self._pos} batches in epoch {self._epoch}, "
                f"but an epoch was counted as {self.steps_per_epoch} full batches; give "
                f"steps_per_epoch to match the data, or make len() tell the truth"
            )
        x, y = as_batch(item, where)
        if self.spec is None:
            self.spec = BatchSpec.of(x, y)
            if self.varying_shapes:
                self.spec = self.spec.varying()
            check_batch_split(
                self.spec.batch_size, self.replicas, self.micro_batches, error=RuntimeConfigError
            )
        self.spec.check(x, y, where)
        self._pos += 1
        return x, y

    def micro_batch(self, step: int, j: int) -> tuple[Payload, Tensor]:
        """Inputs and targets of micro-batch ``j`` of global step ``step``, on the device."""
        if step != self._step:
            if step != self._next:
                raise RuntimeError(f"the feed was asked for step {step}, next is {self._next}")
            x, y = self._read()
            m = self.micro_batches
            # the whole mini-batch's (every replica's) counted targets, read before the split
            # and on the host where the data is: the last stage weighs each micro-batch's
            # loss by its share of them (``stage.loss.token_share``)
            counted = counted_targets(y)
            self._counted = counted.to(self.device, non_blocking=True)
            # read on the host where the batch is there (no device sync): the last stage in
            # this process then decides its weighting on the host
            self._counted_host = int(counted) if counted.device.type == "cpu" else None
            if self.replicas > 1:  # this replica's shard, before it moves to the device
                x, y = (
                    split(x, self.replicas)[self.replica],
                    y.tensor_split(self.replicas)[self.replica],
                )
            x = to_device(x, self.device)
            y = y.to(self.device, non_blocking=True)
            self._parts = (split(x, m), y.tensor_split(m))
            self._step, self._next = step, step + 1
        return self._parts[0][j], self._parts[1][j]

    def counted(self, step: int) -> Tensor:
        """The counted (not ignored) targets of global step ``step``'s whole mini-batch, over
        every replica: a one-element int64 tensor on the device, which travels to the last
        stage with each micro-batch's targets. Read after :meth:`micro_batch` of that step."""
        if step != self._step:
            raise RuntimeError(f"the feed holds step {self._step}, asked for {step}'s count")
        return self._counted

    def counted_here(self, step: int) -> Tensor | int:
        """:meth:`counted` for a last stage in this process: an int where the batch was read
        on the host (free to read), else the device tensor."""
        counted = self.counted(step)
        return counted if self._counted_host is None else self._counted_host


class EvalReader:
    """Evaluation batches in chunks of at most ``chunk``, any sizes, checked against the
    training batches' per-sample shapes."""

    def __init__(self, data: Iterable[Any], spec: BatchSpec | None, chunk: int = 64) -> None:
        self._it = iter(data)
        self.spec = spec
        self.chunk = chunk
        self._index = 0

    def next_chunk(self) -> list[tuple[Payload, Tensor]]:
        out: list[tuple[Payload, Tensor]] = []
        for item in itertools.islice(self._it, self.chunk):
            x, y = as_batch(item, f"evaluation batch {self._index}")
            if self.spec is None:
                self.spec = BatchSpec.of(x, y)
            self.spec.check(x, y, f"evaluation batch {self._index}", any_size=True)
            out.append((x, y))
            self._index += 1
        return out
