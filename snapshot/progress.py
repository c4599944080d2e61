"""Progress of a push or a pull on the terminal, and other libraries' progress bars kept to the terminal."""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


class Progress:
    """Bytes and blobs moved, with rates, on stderr when it is a terminal; silent otherwise or when quiet.
    Thread-safe: parts and uploads report from worker threads."""

    def __init__(self, desc: str, *, quiet: bool = False, file: Any = None) -> None:
        self.desc = desc
        self.file = file or sys.stderr
        self.enabled = not quiet and bool(getattr(self.file, "isatty", lambda: False)())
        self._bar: Any = None
        self._lock = threading.Lock()
        self._blobs_total = 0
        self._blobs_done = 0
        self._started = 0.0

    def start(self, total_bytes: int, total_blobs: int) -> None:
        self._blobs_total = total_blobs
        self._started = time.monotonic()
        if self.enabled and total_blobs:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self._bar = tqdm(total=total_bytes, desc=self.desc, unit="B", unit_scale=True,
                             file=self.file, dynamic_ncols=True)
            self._bar.set_postfix_str(self._blobs_text(), refresh=False)

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(nbytes)

    def blob_done(self) -> None:
        with self._lock:
            self._blobs_done += 1
            if self._bar is not None:
                self._bar.set_postfix_str(self._blobs_text())

    def forget(self, nbytes: int) -> None:
        """A blob that another process brought in: no longer ours to count."""
        with self._lock:
            self._blobs_total -= 1
            if self._bar is not None:
                self._bar.total -= nbytes
                self._bar.set_postfix_str(self._blobs_text())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _blobs_text(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return f"{self._blobs_done}/{self._blobs_total} blobs, {self._blobs_done / elapsed:.1f} blobs/s"


def as_progress(progress: bool | Progress | None, desc: str) -> Progress:
    """What a ``progress`` argument asks for: that reporter itself, or a new one that is quiet unless true."""
    if isinstance(progress, Progress):
        return progress
    return Progress(desc, quiet=not progress)


@contextlib.contextmanager
def bars_on_terminal_only() -> Iterator[None]:
    """Other libraries' tqdm bars (transformers converting a GGUF) on stderr only when it is a terminal: in a log
    their carriage-return redraws pile up. What they write without a carriage return (warnings) goes through."""
    if getattr(sys.stderr, "isatty", lambda: False)():
        yield
        return
    with contextlib.redirect_stderr(_WithoutRedraws(sys.stderr)):
        yield


class _WithoutRedraws(io.TextIOBase):
    def __init__(self, out: Any) -> None:
        self.out = out

    def write(self, text: str) -> int:
        if "\r" not in text and text.strip():
            self.out.write(text)
        return len(text)

    def flush(self) -> None:
        self.out.flush()
