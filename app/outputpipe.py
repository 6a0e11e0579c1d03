"""One of a model's output pipes, read without blocking: its bytes cut into what goes to the log
and the complete lines to parse for progress.

A line longer than LINE_LIMIT_BYTES goes to the log in pieces as it comes (so stdout and stderr
still interleave by lines, and no line is held in memory whole) and is never parsed.
"""

from __future__ import annotations

import os

LINE_LIMIT_BYTES = 64 * 1024  # longer stdout/stderr lines are logged in pieces and never parsed


class OutputPipe:
    """One of the child's output pipes: its read end (non-blocking) and the line it is in the middle of."""

    __slots__ = ("fd", "overlong", "parse", "partial")

    def __init__(self, fd: int, *, parse: bool) -> None:
        os.set_blocking(fd, False)
        self.fd, self.parse = fd, parse
        self.partial = b""  # the start of a line whose newline has not come yet
        self.overlong = False  # the line in progress went to the log in pieces: it is never parsed

    def feed(self, data: bytes) -> tuple[bytes, list[bytes]]:
        """Take bytes read; return what goes to the log now (whole lines, or a piece of an overlong
        one, so the two streams interleave by lines) and the complete lines to parse."""
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            self.partial += data
            return self._overflow(), []
        ready, self.partial = self.partial + data[:cut], data[cut:]
        lines = self._lines(ready) if self.parse and b"PROGRESS" in ready else []
        self.overlong = False
        return ready + self._overflow(), lines

    def rest(self) -> tuple[bytes, list[bytes]]:
        """The last, unterminated line: for the log, and to parse unless it was overlong."""
        rest, self.partial = self.partial, b""
        return rest, [rest] if self.parse and rest and not self.overlong else []

    def _overflow(self) -> bytes:
        """A line in progress beyond LINE_LIMIT_BYTES, taken out for the log; else b""."""
        if len(self.partial) <= LINE_LIMIT_BYTES:
            return b""
        piece, self.partial, self.overlong = self.partial, b"", True
        return piece

    def _lines(self, ready: bytes) -> list[bytes]:
        """The lines in `ready` (which ends with a newline) short enough to parse."""
        lines = ready.split(b"\n")[:-1]
        if self.overlong:  # the first is the end of a line that went out in pieces
            del lines[0]
        return [line for line in lines if len(line) <= LINE_LIMIT_BYTES]
