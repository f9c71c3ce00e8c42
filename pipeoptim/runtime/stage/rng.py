"""A stage's own random-number stream (dropout and the like).

Why: results must not depend on how many stages share a process (the local transport runs all
of them in one, dist one per rank), and a checkpoint must restore the stream exactly. So every
pass of a stage runs under that stage's generator state, swapped in and out around it. A stage
whose modules draw no random numbers skips the two state copies per pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["StageRandom", "draws_random_numbers"]

_RANDOM_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)


def draws_random_numbers(module: nn.Module) -> bool:
    """Whether a pass through ``module`` may draw random numbers: a dropout-like layer, a
    layer with a dropout rate above 0 (attention), or any module not from torch.nn (user
    code may call torch.rand): conservative, since a wrong False changes results."""
    for sub in module.modules():
        if isinstance(sub, _RANDOM_MODULES):
            return True
        if not type(sub).__module__.startswith("torch.nn"):
            return True
        rate = getattr(sub, "dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            return True
    return False


class StageRandom:
    """The generator state of one stage, seeded from ``seed`` on ``device``."""

    def __init__(self, module: nn.Module, device: torch.device, seed: int) -> None:
        self.device = device
        self.used = draws_random_numbers(module)
        """Whether passes run under the stream at all (see :func:`draws_random_numbers`)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        self.state: Tensor = gen.get_state()

    @contextmanager
    def stream(self) -> Iterator[None]:
        """Run under this stage's stream; the process's own stream is left as it was."""
        if not self.used:
            yield
            return
        cuda = self.device.type == "cuda"
        saved = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
        if cuda:
            torch.cuda.set_rng_state(self.state, self.device)
        else:
            torch.set_rng_state(self.state)
        try:
            yield
        finally:
            if cuda:
                self.state = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved, self.device)
            else:
                self.state = torch.get_rng_state()
                torch.set_rng_state(saved)
