"""``pipeoptim export``: a run's per-stage checkpoint as one state dict in the model's names.

The work is :mod:`pipeoptim.runtime.checkpoint.export`'s; this module reads the command
line and says what it wrote.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeoptim.runtime.checkpoint.export import EXPORT_FORMATS, export_checkpoint

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  pipeoptim export --checkpoint-dir ckpt --out model.pt
  pipeoptim export --checkpoint-dir ckpt --out model.safetensors --step 200
  pipeoptim export --checkpoint-dir ckpt --out gpt2-trained --format hf   # from_pretrained folder
"""


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "export",
        help="write a run's checkpoint as one state dict (or a Hugging Face folder)",
        description="Merge the per-stage files of a checkpoint into one state dict keyed by "
        "the model's own module names (for a model given as plain units: as an nn.Sequential "
        "of them names it). A weight shared across stages is written once under each name.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint-dir", type=Path, required=True, metavar="DIR", help="the run's folder"
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="PATH",
        help="*.pt, *.safetensors, or a folder with --format hf",
    )
    p.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default=None,
        help="pt, safetensors or hf (default: from the --out suffix)",
    )
    p.add_argument(
        "--step", type=int, default=None, help="the checkpoint's step (default: the latest)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    written = export_checkpoint(args.checkpoint_dir, args.out, fmt=args.format, step=args.step)
    print(f"wrote {written}")
    return 0
