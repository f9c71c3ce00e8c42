"""``JsonlLogger``'s target is a file: an existing directory is refused when the logger is
built, so ``pipeoptim train --log jsonl:DIR`` stops at its up-front check (exit 2, one line)
instead of failing at the fit's start with an IsADirectoryError."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeoptim import JsonlLogger
from pipeoptim.cli import main
from pipeoptim.errors import RuntimeConfigError


def test_an_existing_directory_is_refused_with_a_file_in_it_as_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RuntimeConfigError) as refused:
        JsonlLogger(tmp_path)
    message = str(refused.value)
    assert "is an existing directory" in message and repr(str(tmp_path)) in message
    assert f"jsonl:{tmp_path / 'run.jsonl'}" in message
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeConfigError, match=r"'\.' is an existing directory.*jsonl:run"):
        JsonlLogger(".")
    assert JsonlLogger(tmp_path / "run.jsonl").path == tmp_path / "run.jsonl"


def test_train_refuses_a_directory_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "--log", f"jsonl:{tmp_path}", "--max-steps", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "IsADirectoryError" not in err
    assert err.strip().splitlines() == [
        f"pipeoptim train: error: jsonl: the target is the file the records are appended to, "
        f"but {str(tmp_path)!r} is an existing directory; name a file in it, e.g. "
        f"jsonl:{tmp_path / 'run.jsonl'}"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written
