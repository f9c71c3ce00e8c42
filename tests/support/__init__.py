"""Helpers the tests share: worker scripts that torchrun starts by path, launch helpers,
comparisons and small models. Test files import from here, never from one another.

``tests/`` is on ``sys.path`` (pytest's ``pythonpath``), and ``tests/conftest.py`` puts it on
the ``PYTHONPATH`` of the processes the tests start, so a rank that loads a test file by path
imports ``support`` too."""

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
"""This folder: the worker scripts that torchrun starts by path live here."""
ROOT = FOLDER.parents[1]
"""The repository's root (the working directory of the launches)."""
