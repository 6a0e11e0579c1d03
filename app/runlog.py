"""A run's log: what the model printed, the worker's own lines about the run, and the recent tail.

The file is made when the model first writes something. A run that stays quiet and ends well
leaves no file: making one is the costliest system call of a no-op job, and would say only what
the job's events already say (when it started and ended). The worker's lines wait in memory until
the model speaks; `close(keep=True)`, for a run that ended badly, writes them even then, so every
failure has a log that says why. A failing disk never stops the pipes: the tail keeps everything.

A cap (`max_bytes`, GPUJOBS_MAX_LOG_MB) bounds the file, so a model that prints without end cannot
fill the host's disk. A job's log keeps its head, whole lines up to the cap; what comes after is
only counted, and at `close()` one line of the worker's says how many bytes were left out, followed
by the run's last lines (those of the in-memory tail that came after the head). A runner's
long-lived log (`rotate`) instead moves a full file to `<name>.1`, replacing the older one, and goes
on in a fresh file. Either way the pipes are read as before and the tail is the same.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import BinaryIO

from app import folders

_LOG = logging.getLogger("gpujobs.runlog")

TAIL_BYTES = 4096
TAIL_LINES = 40
# A log write failing so is the host's disk full (or its quota used up): said in the tail too, where
# the run's verdict looks for it (app/queue/verdict.py, disk_trouble), since the model's own writes
# to that disk (its outputs) most likely failed as well, and the job is not to be charged for that.
_FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT})


def open_log(path: Path) -> BinaryIO:
    """A log opened to append to, unbuffered; its folder is made only if missing (usually it is
    there already: a system call saved per job)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, folders.FILE_MODE)  # not the umask's mode: closed to other users
    except FileNotFoundError:
        folders.make_folder(path.parent)
        fd = os.open(path, flags, folders.FILE_MODE)
    return os.fdopen(fd, "ab", buffering=0)


class RunLog:
    """One append-only log file, made at the model's first byte (or at once, when `eager`), kept
    within `max_bytes` (0: no cap) by keeping its head, or by rotating it (`rotate`)."""

    def __init__(
        self, path: Path, tag: str, *, eager: bool = False, max_bytes: int = 0, rotate: bool = False
    ) -> None:
        self.path = path
        self._tag = tag  # marks the worker's own lines: "[runner] exit code 1"
        self._file: BinaryIO | None = None
        self._waiting: list[bytes] | None = []  # the worker's lines, until the file is made; then None
        self._tail = bytearray()
        self._max_bytes = max_bytes
        self._rotate = rotate
        self._size = 0  # the file's length
        self._left_out = 0  # bytes past the head, not written (the cap reached, without `rotate`)
        self._line_ended = True  # whether the last byte written was a newline
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

    def note(self, text: str, *, command: str = "") -> None:
        """One line of the worker's own: in the file if there is one, else waiting for it. A
        `command` (a model's command line, with the request's params in it) is added in the file
        only: the tail is what a failed run is judged by (a full disk, the model's out-of-memory
        patterns), and a param's text must not pass for the model's words there."""
        line = f"[{self._tag}] {text}\n".encode()
        self._keep(line)
        if command:
            line = f"[{self._tag}] {text}: {command}\n".encode()
        if self._waiting is not None:
            self._waiting.append(line)
        else:
            self._put(line)

    def close(self, *, keep: bool = False) -> None:
        """Close the file (a capped one ends with what was left out and the last lines); with `keep`,
        make it for the worker's lines if the model said nothing. Later writes reach only the tail."""
        if keep and self._waiting:
            self._open()
        self._waiting = None
        if self._left_out and self._file is not None:
            self._write(self._ending())
        self._shut()

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
            self._size = os.fstat(self._file.fileno()).st_size
        except OSError as exc:
            self._failed("cannot open a run log", exc)
            return
        self._put(b"".join(waiting))

    def _put(self, data: bytes) -> None:
        """Write `data`, or what of it the cap allows."""
        if self._file is None or not data:
            return
        if self._max_bytes and self._rotate:
            self._put_rotating(data)
        elif self._left_out or (self._max_bytes and self._size + len(data) > self._max_bytes):
            self._put_head(data)
        else:
            self._write(data)

    def _put_head(self, data: bytes) -> None:
        """At the cap: write the whole lines that fit, count the rest as left out. Output without a
        newline (a progress bar redrawn with carriage returns, a piece of an overlong line) fills
        the head up to the cap."""
        if not self._left_out:
            room = max(self._max_bytes - self._size, 0)
            cut = _lines_within(data, room) or (room if b"\n" not in data else 0)
            self._write(data[:cut])
            data = data[cut:]
            _LOG.warning(
                "a run log reached its cap; its head and last lines are kept",
                extra={"action": "log_capped", "path": str(self.path), "max_bytes": self._max_bytes},
            )
        self._left_out += len(data)

    def _put_rotating(self, data: bytes) -> None:
        """Write whole lines while they fit, rotate the file when the next does not.

        The size is the file's own, not a count of ours: two runners of a model on a GPU share a
        runner.log, and either may have written or rotated it."""
        while data and self._file is not None:
            self._size = os.fstat(self._file.fileno()).st_size
            if self._size + len(data) <= self._max_bytes:
                self._write(data)
                return
            room = max(self._max_bytes - self._size, 0)
            cut = _lines_within(data, room) or (room if self._size == 0 else 0)
            self._write(data[:cut])
            data = data[cut:]
            if data:
                self._roll()

    def _roll(self) -> None:
        """Move the full file to `<name>.1` (replacing an older one) and open a fresh one; when
        another writer has moved it already, only open the fresh one."""
        assert self._file is not None
        try:
            if _same_file(self.path, self._file):
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                _LOG.info("log rotated", extra={"action": "log_rotated", "path": str(self.path)})
            self._file.close()
            self._file = open_log(self.path)
            self._size = os.fstat(self._file.fileno()).st_size
        except OSError as exc:
            self._failed("cannot rotate a log", exc)

    def _ending(self) -> bytes:
        """What a capped log ends with: a line saying how many bytes were left out, then the last
        lines of the tail among them."""
        last = bytes(self._tail[-min(self._left_out, TAIL_BYTES) :])
        if len(last) < self._left_out:  # it starts within a line: from the next one
            last = last[last.find(b"\n") + 1 :]
        lines = last.split(b"\n")
        last = b"\n".join(lines[-(TAIL_LINES + last.endswith(b"\n")) :])
        cap = self._max_bytes
        size = f"{cap // 2**20} MiB" if cap % 2**20 == 0 else f"{cap} bytes"
        line = (
            f"[{self._tag}] log cap of {size} reached: {self._left_out - len(last)} bytes left out; "
            "the last lines follow\n"
        )
        return (b"" if self._line_ended else b"\n") + line.encode() + last

    def _write(self, data: bytes) -> None:
        if self._file is None or not data:
            return
        try:
            self._file.write(data)
        except OSError as exc:
            self._failed("cannot write a run log", exc)
            return
        self._size += len(data)
        self._line_ended = data.endswith(b"\n")

    def _failed(self, what: str, exc: OSError) -> None:
        """The file cannot be written: say so (once: nothing more is written to it), and in the
        tail too when the disk is full."""
        _LOG.error("%s: %s", what, exc, extra={"action": "log_write_failed", "path": str(self.path)})
        if exc.errno in _FULL_DISK:
            self._keep(f"[{self._tag}] {what}: {exc}\n".encode())
        self._shut()

    def _shut(self) -> None:
        """Close the file, if open; nothing more is written to it."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # unbuffered: nothing is left to write
                self._file.close()
            self._file = None


def _lines_within(data: bytes, room: int) -> int:
    """The length of the whole lines at the start of `data` that fit in `room` bytes (0: none)."""
    return data.rfind(b"\n", 0, room) + 1


def _same_file(path: Path, file: BinaryIO) -> bool:
    """Whether `path` still names the open `file` (not a fresh one made since, nor nothing)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(file.fileno()))
    except FileNotFoundError:
        return False
