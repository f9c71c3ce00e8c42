"""Built-in data sets and the deterministic order in which a run visits them.

The built-in data sets reach the pipeline as :class:`DatasetLoader` iterables, exactly as a
user's ``DataLoader`` does. Their order is a pure function of ``(seed, step)``, which is
what lets a checkpoint store its data position as one integer and a resumed run visit
exactly the samples an uninterrupted one would.

Nothing here downloads: ``digits`` is scikit-learn's bundled 8x8 digits (read straight from
the package's data file when possible, so a worker process need not import scikit-learn),
``majority`` is generated from a fixed seed.
"""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.feed import epoch_seed

__all__ = ["BatchOrder", "Dataset", "DatasetLoader", "digits", "majority"]

SPLIT_SEED = 0
"""The train/test split is fixed, independent of ``--seed``, so accuracies compare."""


@dataclass
class Dataset:
    """A classification data set held in memory."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int

    def __post_init__(self) -> None:
        for split, x, y in (
            ("train", self.train_x, self.train_y),
            ("test", self.test_x, self.test_y),
        ):
            if len(x) != len(y):
                raise RuntimeConfigError(
                    f"data set {self.name!r}: {split} inputs and labels differ in length "
                    f"({len(x)} and {len(y)}); return one label per sample"
                )
        if len(self.train_x) == 0:
            raise RuntimeConfigError(f"data set {self.name!r} has no training samples")


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0], "datasets", "data", "digits.csv.gz") if locations else None
    if path is not None and path.is_file():
        with gzip.open(path, "rt") as f:
            raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return raw[:, :-1], raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # the documented route, slower to import

    bunch = load_digits()
    return bunch.data.astype(np.float32), bunch.target.astype(np.int64)


def _stratified_split(
    y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        cut = round(len(idx) * test_fraction)
        test.append(idx[:cut])
        train.append(idx[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def digits() -> Dataset:
    """8x8 handwritten digits, 64 features standardised with the training statistics."""
    x, y = _digits_arrays()
    train, test = _stratified_split(y, 0.2, SPLIT_SEED)
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std[std < 1e-6] = 1.0  # border pixels are always 0
    x = (x - mean) / std
    return Dataset(
        "digits",
        torch.from_numpy(x[train]).float(),
        torch.from_numpy(y[train]),
        torch.from_numpy(x[test]).float(),
        torch.from_numpy(y[test]),
        10,
    )


def majority(length: int = 15, train: int = 4096, test: int = 1024) -> Dataset:
    """Random bit strings; the label says whether ones are the majority (length is odd)."""
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    bits = torch.randint(0, 2, (train + test, length), generator=gen)
    labels = (bits.sum(dim=1) * 2 > length).long()
    return Dataset("majority", bits[:train], labels[:train], bits[train:], labels[train:], 2)


class BatchOrder:
    """Which training samples mini-batch ``step`` holds: epoch e visits a permutation drawn
    from ``(seed, e)``; the last incomplete batch of an epoch is dropped so every
    micro-batch has the same shape (the receiving ranks pre-allocate their buffers)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if batch_size > num_samples:
            raise RuntimeConfigError(
                f"batch size {batch_size} is larger than the training set ({num_samples} "
                f"samples); use --batch-size {num_samples} or less"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = num_samples // batch_size
        self._perm: tuple[int, Tensor] | None = None

    def indices(self, step: int) -> Tensor:
        epoch, pos = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._perm[1][pos * self.batch_size : (pos + 1) * self.batch_size]


class DatasetLoader:
    """A built-in data set's batches as an iterable of ``(input, target)``, the form
    :class:`~pipeoptim.runtime.pipeline.Pipeline` reads any data in.

    Training (``shuffle``): epoch e visits the :class:`BatchOrder` permutation of
    ``(seed, e)`` in full batches; ``set_epoch`` selects the epoch, as with PyTorch's
    ``DistributedSampler``. Evaluation (``shuffle=False``): the samples in order, the last
    batch possibly smaller.
    """

    def __init__(
        self, x: Tensor, y: Tensor, batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        self.x, self.y = x, y
        self.shuffle = shuffle
        self.batch_size = batch_size
        self.order = BatchOrder(len(x), batch_size, seed) if shuffle else None
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.order is not None:
            return self.order.steps_per_epoch
        return -(-len(self.x) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self.order is None:
            for lo in range(0, len(self.x), self.batch_size):
                yield self.x[lo : lo + self.batch_size], self.y[lo : lo + self.batch_size]
            return
        first = self.epoch * self.order.steps_per_epoch
        for step in range(first, first + self.order.steps_per_epoch):
            idx = self.order.indices(step)
            yield self.x[idx], self.y[idx]
