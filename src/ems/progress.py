"""The progress bar of ``ems bench`` and ``ems demo``, on stderr: tqdm when it is
importable, else a plain one-line bar; not on a terminal, one line per stage (the
label's part before a colon), no carriage returns in logs."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """``Progress(total)``; ``step(label)`` after each unit of work; ``close()``.
    ``name`` starts the lines written when the stream is not a terminal."""

    def __init__(self, total: int, enabled: bool = True, stream: Optional[TextIO] = None,
                 name: str = "bench") -> None:
        self.total = max(1, total)
        self.name = name
        self.done = 0
        self.enabled = enabled
        self._stream = stream or sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._t0 = time.monotonic()
        self._last_label = ""
        self._tqdm: Any = None
        if enabled and self._tty:
            try:
                from tqdm import tqdm  # optional
                self._tqdm = tqdm(total=self.total, file=self._stream, unit="step",
                                  dynamic_ncols=True, leave=False)
            except ImportError:
                pass

    def set_total(self, total: int) -> None:
        self.total = max(1, total)
        if self._tqdm is not None:
            self._tqdm.total = self.total
            self._tqdm.refresh()

    def step(self, label: str, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_description_str(label, refresh=False)
            self._tqdm.update(n)
            return
        if self._tty:
            width = 28
            filled = int(width * self.done / self.total)
            bar = "#" * filled + "-" * (width - filled)
            elapsed = time.monotonic() - self._t0
            self._stream.write(f"\r[{bar}] {self.done:3d}/{self.total} {elapsed:5.0f}s "
                               f"{label[:40]:40s}")
            self._stream.flush()
        elif label.split(":")[0] != self._last_label.split(":")[0]:
            # not a terminal: one line per workload, no carriage returns in logs
            elapsed = time.monotonic() - self._t0
            self._stream.write(f"{self.name}: {label} ({self.done}/{self.total}, "
                               f"{elapsed:.0f}s)\n")
            self._stream.flush()
        self._last_label = label

    def note(self, message: str) -> None:
        """A line that stays (a skipped peer, a warning)."""
        if self._tqdm is not None:
            self._tqdm.write(message, file=self._stream)
            return
        if self._tty and self.enabled:
            self._stream.write("\r" + " " * 90 + "\r")
        self._stream.write(message + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._tty and self.enabled:
            self._stream.write("\r" + " " * 90 + "\r")
            self._stream.flush()
