"""Model names to what a run trains: layers, data set and loss (``--model NAME``).

A pipeline splits a model at layer boundaries, so every model is a flat list of layers (an
``nn.Sequential``). The built-in ones (:data:`BUILTIN_MODELS`):

* ``mlp``, ``cnn``, ``transformer``: :mod:`pipeoptim.workloads.classifiers`, on ``digits``
  and ``majority`` (:mod:`pipeoptim.workloads.data`);
* ``gpt``: a 9-unit decoder-only transformer, next-character prediction on the Python
  standard library's own source (:mod:`pipeoptim.workloads.gpt`), trained with a per-token
  loss; ``gpt-deep``: the same model family with 7 blocks cut into attention and MLP halves
  (17 units, for pipelines of up to 16 stages), on windows of 32 characters (``gpt``: 64);
  ``gpt-deeper``: 16 blocks cut in halves (35 units, up to 32 stages) on the same windows.

A user model is ``module:factory`` or ``path/to/file.py:factory``: ``factory()`` returns an
``nn.Sequential`` or a list of modules. It trains on ``digits`` (input: a float tensor of 64
features per sample, 10 classes) unless the factory's module defines ``dataset()`` returning
a :class:`~pipeoptim.workloads.data.Dataset` (or a tuple ``(train_x, train_y, test_x,
test_y)``; the class count is then ``max(label) + 1``). The last layer's output is the
logits of a cross-entropy loss. Every rank builds the whole model from the same seed and
keeps its own stages, so initial weights do not depend on the transport.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.workloads.classifiers import cnn, mlp, transformer
from pipeoptim.workloads.data import Dataset, digits, majority
from pipeoptim.workloads.gpt import (
    gpt,
    gpt_deep,
    gpt_deeper,
    lm_loss,
    python_corpus,
    python_corpus_deep,
)

__all__ = [
    "BUILTIN_LOSSES",
    "BUILTIN_MODELS",
    "build_model",
    "model_loss",
]


BUILTIN_MODELS: dict[str, tuple[Callable[[], list[nn.Module]], Callable[[], Dataset]]] = {
    "mlp": (mlp, digits),
    "cnn": (cnn, digits),
    "transformer": (transformer, majority),
    "gpt": (gpt, python_corpus),
    "gpt-deep": (gpt_deep, python_corpus_deep),
    "gpt-deeper": (gpt_deeper, python_corpus_deep),
}
BUILTIN_LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "gpt": lm_loss,
    "gpt-deep": lm_loss,
    "gpt-deeper": lm_loss,
}
"""Built-in models whose loss is not plain cross-entropy on class labels."""


def _import(module_part: str, spec: str) -> ModuleType:
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise RuntimeConfigError(f"model {spec!r}: no file {module_part!r}")
        name = f"pipeoptim_user_model_{path.stem}"
        if name in sys.modules:
            return sys.modules[name]
        file_spec = importlib.util.spec_from_file_location(name, path)
        if file_spec is None or file_spec.loader is None:
            raise RuntimeConfigError(f"model {spec!r}: cannot import {module_part!r}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = module
        file_spec.loader.exec_module(module)
        return module
    if "" not in sys.path:  # like `python -m`, resolve modules from the working directory
        sys.path.insert(0, "")
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as err:
        raise RuntimeConfigError(
            f"model {spec!r}: cannot import module {module_part!r} ({err}); run from the "
            f"directory that holds it or give a file path, e.g. examples/custom_model.py:make_model"
        ) from None


def _user_dataset(module: ModuleType, spec: str) -> Dataset:
    make = getattr(module, "dataset", None)
    if make is None:
        return digits()
    data: Any = make()
    if isinstance(data, Dataset):
        return data
    if isinstance(data, tuple) and len(data) == 4:
        train_x, train_y, test_x, test_y = (torch.as_tensor(t) for t in data)
        classes = int(max(int(train_y.max()), int(test_y.max()) if len(test_y) else 0)) + 1
        return Dataset(f"{spec}:dataset", train_x, train_y.long(), test_x, test_y.long(), classes)
    raise RuntimeConfigError(
        f"model {spec!r}: dataset() returned {type(data).__name__}; return a "
        f"pipeoptim.workloads.data.Dataset or (train_x, train_y, test_x, test_y)"
    )


def build_model(name: str, seed: int) -> tuple[list[nn.Module], Dataset]:
    """The model's layers, initialised from ``seed``, and the data set it trains on."""
    if name in BUILTIN_MODELS:
        factory, make_data = BUILTIN_MODELS[name]
        torch.manual_seed(seed)
        return factory(), make_data()
    if ":" not in name:
        raise RuntimeConfigError(
            f"unknown model {name!r}; choose one of: {', '.join(BUILTIN_MODELS)}, or give "
            f"your own as module:factory (e.g. examples/custom_model.py:make_model)"
        )
    module_part, _, attr = name.rpartition(":")
    module = _import(module_part, name)
    factory_fn = getattr(module, attr, None)
    if not callable(factory_fn):
        raise RuntimeConfigError(
            f"model {name!r}: {module_part} has no callable {attr!r}; define "
            f"def {attr}() -> nn.Sequential (or a list of layers)"
        )
    torch.manual_seed(seed)
    built = factory_fn()
    layers = list(built) if isinstance(built, (nn.Sequential, list, tuple)) else None
    if not layers or not all(isinstance(m, nn.Module) for m in layers):
        raise RuntimeConfigError(
            f"model {name!r}: {attr}() returned {type(built).__name__}; return an "
            f"nn.Sequential or a non-empty list of nn.Module layers"
        )
    return layers, _user_dataset(module, name)


def model_loss(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss a built-in model trains with (a user module may define ``loss``)."""
    if name in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[name]
    if ":" in name and name not in BUILTIN_MODELS:
        module = _import(name.rpartition(":")[0], name)
        user_loss = getattr(module, "loss", None)
        if callable(user_loss):
            return user_loss  # type: ignore[no-any-return]
    return F.cross_entropy
