"""A worker's hold on its folders below the storage root, so that other workers can tell what a
worker that is gone left behind.

From its start to its stop, each worker holds an exclusive flock on `scratch/<worker>.lock`, a
file holding its id. The kernel lets go of a flock when its process dies, however it dies, so a
lock file that another process can lock belongs to no live worker: its scratch lanes (the images
of the jobs it was running among them) and its runners' temporary folders are what a killed
worker left. Any worker's reap round removes them (`sweep`), so they no longer wait for that
worker's id to start again on the host, which may be never. Scratch folders without a lock file
(an earlier version's worker, which may be running) are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from app import folders

log = logging.getLogger("gpujobs.presence")

LOCK_SUFFIX = ".lock"

# How long a starting worker tries for its lock: another worker may be removing what this id's
# previous life left (a sweep holds the lock while it does). Longer means a second live process
# under the same id, which the fleet refuses at its start anyway.
TAKE_WAIT_S = 5.0


def lock_file(lanes_folder: Path) -> Path:
    """The lock file of the worker whose lanes are `lanes_folder`: beside them."""
    return lanes_folder.with_name(lanes_folder.name + LOCK_SUFFIX)


class Presence:
    """One worker's lock file, held while the worker runs."""

    def __init__(self, lanes_folder: Path, worker_id: str) -> None:
        self.path = lock_file(lanes_folder)
        self._worker_id = worker_id
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self, wait_s: float = TAKE_WAIT_S) -> bool:
        """Hold the lock (blocking, up to `wait_s`); False if another process holds it still.
        OSError if it cannot be had at all (no flock on this file system)."""
        deadline = time.monotonic() + wait_s
        while self._fd is None:
            self._fd = _locked(self.path, create=True)
            if self._fd is None and time.monotonic() >= deadline:
                return False
            if self._fd is None:
                time.sleep(0.05)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, self._worker_id.encode(), 0)  # read by the sweeps of other workers
        return True

    def leave(self) -> None:
        """At a stop, once the lanes are emptied: remove the lock file and let go of it."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


def sweep(scratch: Path, also: Callable[[str], None]) -> list[str]:
    """Remove the scratch lanes of every worker that is gone (its lock file lockable), what
    `also(its id)` removes (its runners' temporary folders), then its lock file, all while holding
    its lock (the id starting again waits); the ids of those workers. A live worker's lock, this
    one's included, and a lock file still being written, are skipped."""
    try:
        names = [e.name for e in os.scandir(scratch) if e.name.endswith(LOCK_SUFFIX)]
    except OSError:
        return []
    gone: list[str] = []
    for name in names:
        try:
            worker_id = _swept(scratch / name, also)
        except OSError as exc:
            if exc.errno == errno.ENOLCK:  # no locks on this file system: nothing can be told
                break
            log.warning(  # tried again next round
                "could not remove what a stopped worker left",
                extra={"action": "presence_sweep_failed", "path": str(scratch / name), "error": str(exc)},
            )
            continue
        if worker_id is not None:
            gone.append(worker_id)
    return gone


def _swept(path: Path, also: Callable[[str], None]) -> str | None:
    """The id of the gone worker whose leftovers were removed, None if its lock was held."""
    fd = _locked(path, create=False)
    if fd is None:
        return None
    try:
        worker_id = os.pread(fd, 4096, 0).decode(errors="replace")
        if not worker_id:  # made and not yet written: its worker is taking it
            return None
        with contextlib.suppress(FileNotFoundError):  # killed before it made a lane
            folders.remove_tree(path.with_name(path.name.removesuffix(LOCK_SUFFIX)))
        also(worker_id)
        path.unlink()
        return worker_id
    finally:
        os.close(fd)


def _locked(path: Path, *, create: bool) -> int | None:
    """An fd of `path` holding its exclusive flock, or None: the lock is held elsewhere, or the file
    is gone (or `create` is False and it does not exist, or it is no file: a folder). The fd is
    checked to be the file at `path` once locked, since a sweep removes the file it locked.
    OSError where locks cannot be had (ENOLCK: a network file system without them)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino == os.lstat(path).st_ino:
            return fd
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.ENOENT):
            os.close(fd)
            raise
    os.close(fd)
    return None
