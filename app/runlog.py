"""A run's log: what the model printed, the worker's own lines about the run, and the recent tail.

The file is made when the model first writes something. A run that stays quiet and ends well
leaves no file: making one is the costliest system call of a no-op job, and would say only what
the job's events already say (when it started and ended). The worker's lines wait in memory until
the model speaks; `close(keep=True)`, for a run that ended badly, writes them even then, so every
failure has a log that says why. A failing disk never stops the pipes: the tail keeps everything.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import BinaryIO

_LOG = logging.getLogger("gpujobs.runlog")

TAIL_BYTES = 4096
TAIL_LINES = 40


def open_log(path: Path) -> BinaryIO:
    """A log opened to append to, unbuffered; its folder is made only if missing (usually it is
    there already: a system call saved per job)."""
    try:
        return path.open("ab", buffering=0)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("ab", buffering=0)


class RunLog:
    """One append-only log file, made at the model's first byte (or at once, when `eager`)."""

    def __init__(self, path: Path, tag: str, *, eager: bool = False) -> None:
        self.path = path
        self._tag = tag  # marks the worker's own lines: "[runner] exit code 1"
        self._file: BinaryIO | None = None
        self._waiting: list[bytes] | None = []  # the worker's lines, until the file is made; then None
        self._tail = bytearray()
        if eager:
            self._open()

    def write(self, data: bytes) -> None:
        """The model's output: the file is made now if it was not."""
        if not data:
            return
        self._keep(data)
        if self._waiting is not None:
            self._open()
        self._put(data)

    def note(self, text: str) -> None:
        """One line of the worker's own: in the file if there is one, else waiting for it."""
        line = f"[{self._tag}] {text}\n".encode()
        self._keep(line)
        if self._waiting is not None:
            self._waiting.append(line)
        else:
            self._put(line)

    def close(self, *, keep: bool = False) -> None:
        """Close the file; with `keep`, make it for the worker's lines if the model said nothing.
        Later writes reach only the tail."""
        if keep and self._waiting:
            self._open()
        self._waiting = None
        if self._file is not None:
            with contextlib.suppress(OSError):  # unbuffered: nothing is left to write
                self._file.close()
            self._file = None

    def tail(self) -> str:
        """The last TAIL_LINES lines within the last TAIL_BYTES bytes, decoded leniently."""
        text = bytes(self._tail[-TAIL_BYTES:]).decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-TAIL_LINES:])

    def _keep(self, data: bytes) -> None:
        self._tail += data
        if len(self._tail) > 2 * TAIL_BYTES:
            del self._tail[:-TAIL_BYTES]

    def _open(self) -> None:
        """Make the file and write the lines waiting for it (once; a failure is logged)."""
        waiting, self._waiting = self._waiting or [], None
        try:
            self._file = open_log(self.path)
        except OSError as exc:
            _LOG.error("cannot open a run log: %s", exc, extra={"action": "log_write_failed"})
            return
        self._put(b"".join(waiting))

    def _put(self, data: bytes) -> None:
        if self._file is None or not data:
            return
        try:
            self._file.write(data)
        except OSError as exc:
            _LOG.error("cannot write a run log: %s", exc, extra={"action": "log_write_failed"})
            self.close()
