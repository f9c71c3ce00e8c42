"""Weights & Biases through ``wandb`` (the ``pipeoptim[wandb]`` extra).

Offline by default: a run is written under ``dir`` (``wandb/offline-run-*``) with no
network, and ``wandb sync DIR/wandb/offline-run-*`` uploads it later. Set ``mode="online"``
(or ``WANDB_MODE=online`` after ``wandb login``) to stream it live. Under ``torchrun`` each
process is one run of a group named after the fit (``group``), named ``rank{r}``. W&B's
own service writes the run file in the background: it can still be filling it for a moment
after the fit returns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.observe.callbacks import FitStart
from pipeoptim.runtime.observe.loggers.base import Logger, check_writable_dir

__all__ = ["WandbLogger"]

MODES = ("offline", "online", "disabled")


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise RuntimeConfigError(
            f"the wandb logger needs the wandb package ({err}); install it with "
            f"pip install 'pipeoptim[wandb]'"
        ) from None
    return wandb


class WandbLogger(Logger):
    """One W&B run per process and fit, in ``project``."""

    scheme = "wandb"

    def __init__(
        self,
        project: str,
        *,
        mode: str | None = None,
        dir: str | Path = ".",
        name: str | None = None,
        group: str | None = None,
    ) -> None:
        super().__init__()
        if not project or "/" in project:
            raise RuntimeConfigError(
                f"wandb: a project name without '/' is needed (got {project!r}), e.g. "
                f"wandb:my-project"
            )
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        if mode not in MODES:
            raise RuntimeConfigError(f"wandb: unknown mode {mode!r}; use one of {', '.join(MODES)}")
        self._wandb = _wandb()
        self.project, self.mode, self.name, self.group = project, mode, name, group
        self.dir = check_writable_dir(Path(dir), "wandb")
        self.run: Any = None
        """The W&B run of the current fit (None between fits)."""
        self.run_dir: Path | None = None
        """The folder of this process's last run (its ``.wandb`` file is in it)."""

    def open(self, info: FitStart) -> None:
        several = info.world > 1
        base = self.name or self.project
        self.run = self._wandb.init(
            project=self.project,
            mode=self.mode,
            dir=str(self.dir),
            name=f"{base}-rank{info.rank}" if several else base,
            group=self.group or (base if several else None),
            config=info.config,
            reinit="create_new",
        )
        self.run_dir = Path(self.run.dir).parent
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write_scalars(self, step: int, values: dict[str, float]) -> None:
        # the fit's own step on the x axis: W&B's step must grow, a loss read late may not
        self.run.log({**values, "step": step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
