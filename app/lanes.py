"""Lanes: the scratch folders a worker's jobs run in, scratch/<worker>/<lane>/ below the storage
root, each holding a job's input image and its model's `out/` folder while it runs.

A worker's lanes are reused job after job, emptied between; a crash leaves at most a lane's
files, which the worker removes when it starts again (`Lanes.reset`), as it does when it stops.
Until then, another worker's reap round removes them (`Lanes.sweep`): while it runs, a worker
holds the lock file beside its lanes (app/presence.py). A lane's input is made 0600
(app/folders.py for the other modes).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from app import folders, presence


class Lanes:
    """The lanes below one scratch folder, and what each holds between jobs."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._made: set[Path] = set()  # lanes known to exist
        self._inputs: dict[Path, str] = {}  # lane -> its input file, kept for the next job to overwrite
        self._held: dict[str, presence.Presence] = {}  # the lock of each worker here, by id

    def folder(self, owner: str) -> Path:
        """The folder of every lane of a worker."""
        return self.scratch / _safe_name(owner)

    def lock_file(self, owner: str) -> Path:
        """The file whose lock a worker holds for its life (app/presence.py)."""
        return presence.lock_file(self.folder(owner))

    def path(self, owner: str, index: int) -> Path:
        """Scratch lane `index` of a worker: a folder reused by one job after another."""
        return self.folder(owner) / str(index)

    def prepare(self, lane: Path, input_name: str, data: bytes) -> None:
        """What an attempt needs in its lane before its model starts: the input image in the
        (otherwise empty) lane and the lane's `out/` folder. (Its log is made, with its folder if
        missing, only once the model prints: app/runlog.py.)

        Lanes are made once and emptied after each job (`clear`) but for the input file, which
        the next job renames if need be, overwrites and cuts to its own length. So a job creates,
        frees and truncates to zero no file in its lane. On this VM's disk (ext4 without a journal)
        each freed inode made later creations slower, as ext4 skips recently freed inodes one by
        one, and that showed as most of a no-op job's CPU.
        """
        try:
            self._put_input(lane, input_name, data)
        except FileNotFoundError:  # the lane was removed since it was made (storage/ cleaned by hand)
            self._made.discard(lane)
            self._put_input(lane, input_name, data)
        self._inputs[lane] = input_name

    def _put_input(self, lane: Path, input_name: str, data: bytes) -> None:
        """Write the input into the lane (made if it was not), over the input the last job kept."""
        if lane not in self._made:
            folders.make_folder(lane / "out")
            self._made.add(lane)
        kept = self._inputs.pop(lane, None)
        if kept is not None and kept != input_name:
            os.replace(lane / kept, lane / input_name)
        fd = os.open(lane / input_name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            view, at = memoryview(data), 0
            while at < len(view):
                at += os.pwrite(fd, view[at:], at)
            if os.fstat(fd).st_size > at:  # the last job's input was longer: none of it may remain
                os.ftruncate(fd, at)
        finally:
            os.close(fd)

    def clear(self, lane: Path) -> bool:
        """Empty a lane for the next job, keeping its `out/` folder (emptied too) and its input
        file (overwritten by the next job's); False if it could not be (the lane is then not to be
        used again)."""
        out = lane / "out"
        name = self._inputs.get(lane)
        try:
            if name is not None and not _plain_file(lane / name):  # replaced by the model: removed
                del self._inputs[lane]
                name = None
            if out.is_symlink() or not out.is_dir():  # replaced by the model: never follow it
                _empty(lane, keep=(name,))
                out.mkdir(mode=folders.FOLDER_MODE)
            else:
                _empty(lane, keep=("out", name))
                _empty(out)
        except OSError:
            self._made.discard(lane)
            self._inputs.pop(lane, None)
            return False
        return True

    def is_clear(self, lane: Path) -> bool:
        """Whether `clear` would find nothing to remove: the lane holds its input file as
        written and an empty `out/` folder, nothing else (as after most jobs). Cheap enough for
        the event loop, where removing what a model left (thousands of files, say) is not."""
        name = self._inputs.get(lane)
        out = lane / "out"
        try:
            if (name is not None and not _plain_file(lane / name)) or out.is_symlink() or not out.is_dir():
                return False
            with os.scandir(lane) as entries:
                if any(entry.name not in ("out", name) for entry in entries):
                    return False
            with os.scandir(out) as entries:
                return next(entries, None) is None
        except OSError:
            return False

    def drop_input(self, lane: Path) -> None:
        """Remove the input a free lane kept for reuse: a user's image is not to stay on disk while
        the worker idles (nor after retention deleted it from the database)."""
        name = self._inputs.pop(lane, None)
        if name is not None:
            with contextlib.suppress(OSError):
                (lane / name).unlink()

    def reset(self, owner: str) -> None:
        """Remove every lane of `owner` (at its start, whatever a previous life left; at its stop,
        the last inputs)."""
        with contextlib.suppress(OSError):
            folders.remove_tree(self.folder(owner))
        self._made.clear()
        self._inputs.clear()

    def hold(self, owner: str) -> bool | None:
        """At `owner`'s start, before `reset`: take the lock that keeps other workers' sweeps off
        its lanes (a few seconds at most, while a sweep removes what its previous life left).
        False if another process holds it still: a live worker of the same id, on another host
        sharing this folder. None where no lock can be had: the lanes are then left to `owner`
        alone, as before locks."""
        held = self._held.setdefault(owner, presence.Presence(self.folder(owner), owner))
        try:
            return held.held or held.take()
        except OSError:  # no flock on this file system
            return None

    def leave(self, owner: str) -> None:
        """At `owner`'s stop: its lanes removed, then its lock."""
        self.reset(owner)
        held = self._held.pop(owner, None)
        if held is not None:
            held.leave()

    def sweep(self, also: Callable[[str], None]) -> list[str]:
        """Remove the lanes of workers that are gone, and what `also(their id)` removes: their
        ids (app/presence.py)."""
        return presence.sweep(self.scratch, also)


def _safe_name(name: str) -> str:
    """A worker id as one folder name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def _empty(folder: Path, keep: Sequence[str | None] = ()) -> None:
    """Remove everything in `folder` but the entries named in `keep`; symlinks are removed, not
    followed. Folders the model made read-only are made writable for it (this process owns them)."""
    try:
        _empty_once(folder, keep)
    except PermissionError:
        folders.make_writable(folder)
        _empty_once(folder, keep)


def _empty_once(folder: Path, keep: Sequence[str | None]) -> None:
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name in keep:
                continue
            if entry.is_dir(follow_symlinks=False):
                folders.remove_tree(entry.path)
            else:
                os.unlink(entry.path)


def _plain_file(path: Path) -> bool:
    """Whether `path` is still the input file as written: a regular file of ours with no other
    name, mode 0600. A link, a folder, a FIFO, a hard link or a changed mode (a model that made
    its input read-only would make the next job's write fail) is removed instead."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_nlink == 1
        and info.st_uid == os.getuid()
        and stat.S_IMODE(info.st_mode) == 0o600
    )
