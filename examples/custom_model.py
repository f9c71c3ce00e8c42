"""A user model: ``pipeoptim train --model examples/custom_model.py:make_model``.

The factory returns the model as a flat list of layers (an ``nn.Sequential`` works too).
The pipeline splits it at layer boundaries, so it needs at least as many layers as stages,
and every layer must take one tensor and return one tensor; the last layer returns the
logits of a cross-entropy loss. ``module:factory`` (an importable module) works as well as
``path/to/file.py:factory``.

This module defines no ``dataset()``, so the model trains on the built-in ``digits`` data:
64 standardised float features per sample, 10 classes. To train on your own data, add to
the module::

    def dataset():
        # tensors; labels are class indices
        return train_x, train_y, test_x, test_y

(or return a ``pipeoptim.workloads.data.Dataset``); define ``loss(output, target)`` to train
with another loss than cross-entropy. For full control (your DataLoader, optimizer,
schedule, precision) use the library instead: ``examples/library_quickstart.py``.
Examples::

    pipeoptim train --model examples/custom_model.py:make_model --stages 4
    pipeoptim train --model examples/custom_model.py:make_model --method pipedream \\
        --optimizer adam --lr 1e-3 --transport dist
"""

from __future__ import annotations

from torch import nn


def make_model() -> list[nn.Module]:
    """A 10-layer MLP with layer norms for digits (64 features -> 10 classes)."""
    return [
        nn.Linear(64, 96),
        nn.GELU(),
        nn.LayerNorm(96),
        nn.Linear(96, 96),
        nn.GELU(),
        nn.Linear(96, 64),
        nn.GELU(),
        nn.LayerNorm(64),
        nn.Linear(64, 32),
        nn.Linear(32, 10),
    ]
