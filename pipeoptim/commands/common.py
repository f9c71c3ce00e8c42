"""Small helpers the sub-commands share: JSON output and table printing."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON instead of text"
    )


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Text left-aligned, numeric columns right-aligned; floats with 4 significant digits."""

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    text = [[cell(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(row[i], (int, float)) for row in rows) if rows else False
        for i in range(len(headers))
    ]
    widths = [max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if numeric[i] else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, text)])
