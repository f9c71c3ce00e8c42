"""TensorBoard through ``torch.utils.tensorboard`` (the ``tensorboard`` package: the
``pipeoptim[tensorboard]`` extra). Scalars as the module ``base`` names them, the run's
configuration as its hyper-parameters (the HPARAMS tab) and as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.observe.callbacks import FitStart
from pipeoptim.runtime.observe.loggers.base import (
    Logger,
    check_writable_dir,
    flat_config,
    per_process_path,
)

__all__ = ["TensorBoardLogger"]


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise RuntimeConfigError(
            f"the tensorboard logger needs the tensorboard package ({err}); install it with "
            f"pip install 'pipeoptim[tensorboard]'"
        ) from None
    return SummaryWriter


class TensorBoardLogger(Logger):
    """Event files in ``directory`` (``directory/rank{r}`` per process when several train):
    ``tensorboard --logdir DIRECTORY`` shows them."""

    scheme = "tensorboard"

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        self._writer_class = _summary_writer()  # a missing package is refused now
        self.directory = check_writable_dir(Path(directory), "tensorboard")
        self.written: Path | None = None
        """The folder this process writes its event files to (once a fit starts)."""
        self._writer: Any = None

    def open(self, info: FitStart) -> None:
        from torch.utils.tensorboard.summary import hparams

        self.written = per_process_path(self.directory, info.rank, info.world, folder=True)
        self._writer = self._writer_class(log_dir=str(self.written))
        self._writer.add_text("config", f"```\n{json.dumps(info.config, indent=2)}\n```", 0)
        # the run's hyper-parameters in this run's own file (add_hparams would make another)
        for summary in hparams(flat_config(info.config), {}):  # type: ignore[no-untyped-call]
            self._writer.file_writer.add_summary(summary)

    def write_scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        super().on_step_end(info, pipeline)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
