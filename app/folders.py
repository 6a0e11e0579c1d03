"""Folders and files below the storage root: made closed to other users, flushed to the disk, and
removed through what a model made read-only.

Modes: what the service makes below the root is closed to other users, whatever the umask allows:
folders FOLDER_MODE (0750), files FILE_MODE (0640), a lane's input 0600; a umask may take more away.
The group may read, as an API running as another user of the workers' group must (results, logs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

FOLDER_MODE = 0o750  # folders below the root: the owner writes, its group reads, others nothing
FILE_MODE = 0o640  # files below the root (published results, logs)


def make_folder(path: Path) -> None:
    """`path`, and the folders missing above it, each made with FOLDER_MODE (less what the umask
    takes away). `Path.mkdir(parents=True)` gives the folders above the process's default mode."""
    try:
        path.mkdir(mode=FOLDER_MODE, exist_ok=True)
    except FileNotFoundError:
        make_folder(path.parent)
        path.mkdir(mode=FOLDER_MODE, exist_ok=True)


def close_to_others(folder: Path) -> None:
    """Take other users' access to `folder` away, if it is this user's (an earlier version made
    its folders with the umask's mode, commonly 0755); its group keeps what it had."""
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(folder)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and info.st_mode & 0o007:
            os.chmod(folder, stat.S_IMODE(info.st_mode) & ~0o007)


def fsync(path: Path, *, mode: int | None = None) -> None:
    """Flush a file's data, or a folder's entries, to the disk; with `mode`, give it that first."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: str | Path) -> None:
    """shutil.rmtree, through folders the model made read-only (made writable first)."""
    try:
        shutil.rmtree(path)
    except PermissionError:
        make_writable(Path(path))
        shutil.rmtree(path)


def remove_quietly(path: Path | None) -> None:
    """`remove_tree`, if there is a `path`, and nothing said if it cannot be removed (or is gone)."""
    if path is not None:
        with contextlib.suppress(OSError):
            remove_tree(path)


def make_writable(top: Path) -> None:
    """Give the owner rwx on `top` and on every folder below it, each before it is opened; links
    are never followed (a link to a folder elsewhere is not a folder here)."""
    _owner_rwx(top)
    for folder, subfolders, _files in os.walk(top):
        for name in subfolders:
            _owner_rwx(Path(folder, name))


def _owner_rwx(path: Path) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.chmod(path, stat.S_IRWXU)
