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

__all__ = ["optimizer_state_bytes", "tensor_bytes", "trainable_bytes"]


def tensor_bytes(tensor: Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def trainable_bytes(module: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in module.parameters() if p.requires_grad)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt``'s state (after a step: what it really keeps)."""
    return sum(
        tensor_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
    )
