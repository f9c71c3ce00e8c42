"""What a layer occupies: the bytes of tensors, trainable parameters and optimizer state.

The profiler records, per layer, its activation, parameter and optimizer-state bytes (and
charges step and prediction times by trainable bytes); these counts are its one definition
of them, shared by the layer timing (:mod:`pipeoptim.runtime.profiling.layer_timing`, which measures
the state a real step leaves), the profiler (:mod:`pipeoptim.runtime.profiling.profiler`) and the
built-in workloads' profiling.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipeoptim.runtime.optim.families import TORCH_FAMILIES

__all__ = ["estimated_state_bytes", "optimizer_state_bytes", "tensor_bytes", "trainable_bytes"]


def tensor_bytes(tensor: Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def trainable_bytes(module: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in module.parameters() if p.requires_grad)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt``'s state (after a step: what it really keeps)."""
    return sum(
        tensor_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
    )


def estimated_state_bytes(module: nn.Module, optimizer: str, factor: int) -> int:
    """The optimizer state of ``module``'s trainable parameters without stepping it:
    ``factor`` times their bytes, except where the state is not a multiple of the parameter
    bytes and the shapes give it exactly (the family's ``shaped_state_bytes``: basis
    rotation's m, v and each rotated side's covariance and basis, with the optimizer's default
    ``max_precondition_dim``)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    family = TORCH_FAMILIES.get(optimizer.lower())
    shaped = None if family is None else family.shaped_state_bytes
    if shaped is not None:
        return sum(shaped(tuple(p.shape), p.element_size()) for p in trainable)
    return factor * sum(tensor_bytes(p) for p in trainable)
