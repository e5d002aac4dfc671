"""A small, dependency-free progress bar for long demo runs (drawn only on a terminal)."""

from __future__ import annotations

import threading
import time
from typing import TextIO

WIDTH = 30


class ProgressBar:
    """One line on ``stream``, redrawn in place: ``[#####-----]  120/500 requests  …``.

    Draws nothing unless ``enabled`` and ``stream`` is a TTY, so piped output and
    ``--json`` runs stay clean. ``total`` grows if more work shows up than expected.
    """

    def __init__(self, stream: TextIO, total: int, *, enabled: bool = True) -> None:
        self.stream = stream
        self.total = max(1, total)
        self.enabled = enabled and stream.isatty()
        self.started = time.monotonic()
        self._drawn = False
        self._lock = threading.Lock()

    def render(self, done: int, total: int, extra: str = "") -> str:
        """The bar's text for ``done`` of ``total`` (at least the expected total)."""
        total = max(self.total, total, done, 1)
        filled = min(WIDTH, done * WIDTH // total)
        elapsed = time.monotonic() - self.started
        line = f"  [{'#' * filled}{'-' * (WIDTH - filled)}] {done:>{len(str(total))}}/{total}"
        line += f" requests  {elapsed:5.1f} s"
        return f"{line}  {extra}" if extra else line

    def update(self, done: int, total: int, extra: str = "") -> None:
        """Redraw the bar."""
        if not self.enabled:
            return
        with self._lock:
            self.stream.write("\r" + self.render(done, total, extra) + "\x1b[K")
            self.stream.flush()
            self._drawn = True

    def clear(self) -> None:
        """Erase the bar's line (before another message is printed)."""
        self._leave_line("\r\x1b[K")

    def close(self) -> None:
        """End the bar's line, leaving its last state visible."""
        self._leave_line("\n")

    def _leave_line(self, ending: str) -> None:
        """Write ``ending`` if the bar is drawn (erasing or ending its line); then it is not."""
        if not self.enabled:
            return
        with self._lock:
            if self._drawn:
                self.stream.write(ending)
                self.stream.flush()
                self._drawn = False
