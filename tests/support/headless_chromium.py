"""Headless Chromium for the tests that look at a rendered report: finding the browser, the
flags this machine needs (no sandbox as root, no background networking on a closed network),
a screenshot and the DOM after plotly drew, and the PNG's header and pixel data."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

__all__ = ["Chromium", "png_chunks"]

_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


class Chromium:
    """One browser profile in ``profile``, a window of ``window`` pixels (width, height),
    ``budget_ms`` of virtual time for the page's scripts."""

    def __init__(self, profile: Path, window: tuple[int, int], budget_ms: int) -> None:
        self.path = self.find()
        if self.path is None:
            pytest.skip(
                "NO BROWSER FOUND: this screenshot test needs headless Chromium "
                "(apt-get install -y chromium); the report itself was not rendered"
            )
        self.flags = [
            *_FLAGS,
            f"--window-size={window[0]},{window[1]}",
            f"--virtual-time-budget={budget_ms}",
            f"--user-data-dir={profile}",
        ]

    @staticmethod
    def find() -> str | None:
        for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
            found = shutil.which(name)
            if found:
                return found
        return None

    def _run(self, *args: str, timeout: float) -> str:
        assert self.path is not None
        done = subprocess.run(
            [self.path, *self.flags, *args],
            check=True,
            capture_output=True,
            timeout=timeout,
            text=True,
        )
        return done.stdout

    def screenshot(self, url: str, png: Path, *, timeout: float) -> None:
        self._run(f"--screenshot={png}", url, timeout=timeout)

    def dom(self, url: str, *, timeout: float) -> str:
        return self._run("--dump-dom", url, timeout=timeout)


def png_chunks(path: Path) -> tuple[tuple[int, ...], bytes]:
    """The IHDR fields and the concatenated (compressed) IDAT data of a PNG file."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None, "no IHDR chunk"
    return header, idat
