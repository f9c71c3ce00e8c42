"""The ``pipeoptim`` command: one sub-command per module in ``pipeoptim.commands``.

Library errors (``ValueError`` subclasses whose messages say the rule, the values and the
fix) are printed without a traceback and exit with status 2. A reader that stops early
(``pipeoptim methods --json | head -1``) ends the command quietly, also with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from pipeoptim import __version__
from pipeoptim.errors import PipeoptimError

# Each module exposes ``register(subparsers)``, which adds its parser and sets ``func``.
COMMAND_MODULES = (
    "pipeoptim.commands.schedule",
    "pipeoptim.commands.simulate",
    "pipeoptim.commands.train",
    "pipeoptim.commands.planning",
    "pipeoptim.commands.calibrate",
    "pipeoptim.commands.compare",
    "pipeoptim.commands.demo",
    "pipeoptim.commands.export",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeoptim",
        description="Plan, simulate and run pipeline-parallel training (PipeOptim and baselines).",
    )
    parser.add_argument("--version", action="version", version=f"pipeoptim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # a command not built in this checkout
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 2
    except PipeoptimError as err:
        print(f"pipeoptim {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pipeoptim {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """The reader closed the pipe: point stdout at devnull so the interpreter's final flush
    does not fail again (the recipe in Python's ``signal`` documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
