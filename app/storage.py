"""ResultStore: the files under storage/ — scratch space, per-attempt logs, published results.

Layout (all below one root):

    scratch/<worker>/<lane>/             input image and the model's output folder, while it runs
                                         (a worker's lanes are reused job after job, emptied between)
    results/<job id>/<attempt>/<name>    published outputs of the attempt that succeeded
    logs/<xy>/<job id>.attempt-<n>.log   stdout and stderr of each attempt (<xy>: the id's first
                                         two hex digits, at most 256 folders, each made with the
                                         first log in it; logs/<job id>/attempt-<n>.log of
                                         earlier versions are still served and pruned)

Results appear only complete: outputs are moved into a hidden folder, then that folder is renamed
into place (one atomic rename). A crash leaves at most a lane's files, which the worker removes
when it starts again (`reset_lanes`), or an unreferenced attempt folder, which the job's end
removes (`drop_attempts`): a later attempt's success, or its failure, cancel or quarantine. A
worker that stops removes its lanes too.

Modes: what the service makes below the root is closed to other users, whatever the umask allows:
folders FOLDER_MODE (0750), files FILE_MODE (0640), a lane's input 0600; a umask may take more away.
The group may read, as an API running as another user of the workers' group must (results, logs).
The folders below the root that an earlier version left open to others are closed at the start.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from app import errors
from app.queue.jobs import Job, ResultFile

LOG_NAME = re.compile(r"attempt-([1-9][0-9]{0,5})\.log\Z")  # as links name logs (\Z: no final line break)
ATTEMPT_DIR = re.compile(r"([1-9][0-9]{0,8})\Z|\.([1-9][0-9]{0,8})\.partial\Z")  # results/<job>/ entries
LOG_FILE = re.compile(r"^([0-9a-f-]{36})\.attempt-[1-9][0-9]{0,5}\.log$")  # as logs are stored
PROBE_BYTES = 1 << 20  # what `probe` asks of the disk: room for a small job's input and outputs
FOLDER_MODE = 0o750  # folders below the root: the owner writes, its group reads, others nothing
FILE_MODE = 0o640  # files below the root (published results, logs)
PARTS = ("scratch", "results", "logs", "runners")  # the folders below the root
# What a program says when a disk is full (ENOSPC) or its quota used up (EDQUOT): C's strerror, which
# Python's OSError shows, Go's lower-case errors, Node's codes.
FULL_DISK = re.compile(r"no space left on device|disk quota exceeded|\bENOSPC\b|\bEDQUOT\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ExpectedOutput:
    """A file the model must (or may) write, with its media type and size cap."""

    name: str
    media_type: str
    required: bool = True
    max_bytes: int = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Download:
    """A file a link names, open for reading (`path` and `file` None: a log that holds nothing
    yet). Once open, it reads whole to its end even if retention deletes it meanwhile."""

    path: Path | None
    file: BinaryIO | None
    media_type: str
    sha256: str | None


class OutputInvalid(errors.AppError):
    """The model exited 0 but its outputs are missing, empty or too large."""


@dataclass(frozen=True, slots=True)
class FoundOutput:
    """A declared output the model wrote, checked but for its hash (ResultStore.find_outputs)."""

    spec: ExpectedOutput
    path: Path
    size: int


def hash_outputs(found: Sequence[FoundOutput]) -> list[ResultFile]:
    """The outputs found, described with their SHA-256 (which reads each whole)."""
    return [ResultFile(f.spec.name, f.size, _sha256(f.path), f.spec.media_type) for f in found]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def full_disk_line(text: str) -> str | None:
    """The last line of `text` (a run's last words) that names a full disk, stripped; None if none."""
    found = [line.strip() for line in text.splitlines() if FULL_DISK.search(line)]
    return found[-1] if found else None


def unusable(path: Path, exc: OSError, reason: str | None = None) -> errors.ConfigError:
    """The error for a path under the storage folder that cannot be used, naming the setting."""
    return errors.ConfigError(f"GPUJOBS_STORAGE_DIR: cannot use {path}: {reason or exc.strerror or exc}")


class ResultStore:
    """Paths and atomic moves below the storage root."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._made: set[Path] = set()  # lanes and runner folders known to exist
        self._inputs: dict[Path, str] = {}  # lane -> its input file, kept for the next job to overwrite
        for part in PARTS:
            folder = self.root / part
            try:
                if part != "runners":  # made with the first warm runner
                    make_folder(folder)
                _close_to_others(folder)
            except OSError as exc:  # a file in the way, or a folder this user cannot write
                raise unusable(
                    folder, exc, "not a folder" if isinstance(exc, FileExistsError) else None
                ) from exc

    def lane_dir(self, owner: str, index: int) -> Path:
        """Scratch lane `index` of a worker: a folder reused by one job after another."""
        return self.root / "scratch" / _safe_name(owner) / str(index)

    def prepare(self, lane: Path, input_name: str, data: bytes, job_id: uuid.UUID, attempt: int) -> Path:
        """Everything an attempt needs on disk before its model starts: the input image in its
        (otherwise empty) lane and the lane's `out/` folder. Returns the path of the attempt's log,
        which is made (with its folder, if missing) only once the model prints (app/runlog.py).

        Lanes are made once and emptied after each job (`clear_lane`) but for the input file, which
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
        return log_file(self.root, job_id, attempt)

    def _put_input(self, lane: Path, input_name: str, data: bytes) -> None:
        """Write the input into the lane (made if it was not), over the input the last job kept."""
        if lane not in self._made:
            make_folder(lane / "out")
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

    def clear_lane(self, lane: Path) -> bool:
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
                out.mkdir(mode=FOLDER_MODE)
            else:
                _empty(lane, keep=("out", name))
                _empty(out)
        except OSError:
            self._made.discard(lane)
            self._inputs.pop(lane, None)
            return False
        return True

    def lane_is_clear(self, lane: Path) -> bool:
        """Whether `clear_lane` would find nothing to remove: the lane holds its input file as
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

    def reset_lanes(self, owner: str) -> None:
        """Remove every lane of `owner` (at its start, whatever a previous life left; at its stop,
        the last inputs)."""
        with contextlib.suppress(OSError):
            _rmtree(self.root / "scratch" / _safe_name(owner))
        self._made = {p for p in self._made if not p.is_relative_to(self.root / "scratch")}
        self._inputs.clear()

    def probe(self, owner: str) -> None:
        """OSError unless `owner`'s scratch folder takes a file of PROBE_BYTES and the results
        folder a new folder: a full disk, a folder gone read-only or removed fails it."""
        lanes = self.root / "scratch" / _safe_name(owner)
        make_folder(lanes)
        with tempfile.TemporaryFile(dir=lanes) as f:  # nameless (O_TMPFILE): a crash leaves nothing
            os.posix_fallocate(f.fileno(), 0, PROBE_BYTES)
        with tempfile.TemporaryDirectory(prefix=".probe-", dir=self.root / "results"):
            pass

    def runner_dir(self, model: str, gpu: int | None) -> Path:
        """The working folder of a warm runner (its HOME and its own log)."""
        path = self.root / "runners" / f"{model}-gpu{'none' if gpu is None else gpu}"
        if path not in self._made:  # asked for on every warm job: made once
            make_folder(path)
            self._made.add(path)
        return path

    def log_path(self, job_id: uuid.UUID, attempt: int) -> Path:
        """Where an attempt's log goes (nothing is made: see `prepare`)."""
        return log_file(self.root, job_id, attempt)

    @staticmethod
    def find_outputs(out_dir: Path, expected: Sequence[ExpectedOutput]) -> list[FoundOutput]:
        """The declared outputs found, with their sizes (`hash_outputs` describes them whole);
        OutputInvalid if one is missing, empty or too large, or if the output folder itself was
        replaced (a link to elsewhere is never followed)."""
        if out_dir.is_symlink() or not out_dir.is_dir():
            raise OutputInvalid("the output folder was replaced by the model: it is not a folder")
        found = []
        for spec in expected:
            path = out_dir / spec.name
            if path.is_symlink() or not path.is_file():
                if spec.required:
                    raise OutputInvalid(f"output {spec.name!r} was not written")
                continue
            size = path.stat().st_size
            if size == 0:
                raise OutputInvalid(f"output {spec.name!r} is empty")
            if size > spec.max_bytes:
                raise OutputInvalid(f"output {spec.name!r} is {size} bytes, over the {spec.max_bytes} cap")
            found.append(FoundOutput(spec, path, size))
        return found

    def publish(self, job_id: uuid.UUID, attempt: int, out_dir: Path, files: Iterable[ResultFile]) -> Path:
        """Move the outputs into results/<job>/<attempt>/ in one atomic rename.

        Files and folders are on disk (fsync) before this returns, so the success written next
        never names files that a crash of the host would leave empty or missing. Each file gets
        FILE_MODE, whatever mode its model gave it."""
        final = self.root / "results" / str(job_id) / str(attempt)
        staging = final.parent / f".{attempt}.partial"
        new_job = not final.parent.is_dir()
        try:
            shutil.rmtree(staging, ignore_errors=True)
            make_folder(staging)
            for f in files:
                os.replace(out_dir / f.name, staging / f.name)
                _fsync(staging / f.name, mode=FILE_MODE)
            _fsync(staging)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            _fsync(final.parent)
            if new_job:
                _fsync(final.parent.parent)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise errors.StorageError(f"could not publish results of job {job_id}: {exc}") from exc
        return final

    def unpublish(self, job_id: uuid.UUID, attempt: int) -> None:
        """Remove an attempt's published results (its completion lost to fencing)."""
        shutil.rmtree(self.root / "results" / str(job_id) / str(attempt), ignore_errors=True)

    def drop_attempts(self, job_id: uuid.UUID, *, upto: int) -> None:
        """Remove the result folders, whole or hidden, of attempts 1 to `upto` of a job that ended:
        at attempt `upto` without success, or at `upto` + 1 with it. A worker that died while
        storing them left them. None of those attempts can ever win the fenced success; a later
        one (after an admin retry) may be storing its results now, and is left alone."""
        folder = self.root / "results" / str(job_id)
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                found = ATTEMPT_DIR.match(entry.name)
                if found and int(found.group(1) or found.group(2)) <= upto:
                    with contextlib.suppress(OSError):
                        _rmtree(entry.path)

    def resolve(self, job: Job, name: str) -> tuple[Path | None, str, str | None]:
        """The file a link names: (path, media type, sha256 or None). Names come from the job row.

        The path is None for the log of an attempt that has none: its model has printed nothing
        (yet) and the run did not end badly (app/runlog.py). That log is empty, not missing."""
        result = job.result(name)
        if result is not None:
            path = self.root / "results" / str(job.id) / str(job.attempt) / result.name
            media_type, sha = result.media_type, result.sha256
        elif (match := LOG_NAME.match(name)) and 1 <= int(match.group(1)) <= job.attempt:
            path = log_file(self.root, job.id, int(match.group(1)))
            if self._lstat(path) is None:  # written by an earlier version: one folder per job
                path = self.root / "logs" / str(job.id) / name
            media_type, sha = "text/plain; charset=utf-8", None
            if self._lstat(path) is None:  # nothing there, not even a link (refused below)
                return None, media_type, sha
        else:
            raise errors.FileNotFound(f"job {job.id} has no file {name!r}")
        # A link anywhere on the way (the file, or a folder: results/<job> linked to another job's)
        # makes the real path differ; the root is resolved, so a path without links is its own.
        info = self._lstat(path)
        if info is None or not stat.S_ISREG(info.st_mode) or os.path.realpath(path) != str(path):
            raise errors.FileNotFound(f"file {name!r} of job {job.id} is not on disk")
        return path, media_type, sha

    def open(self, job: Job, name: str) -> Download:
        """The file a link names (see `resolve`), opened; FileNotFound if it is not on disk, or no
        longer: retention may delete it between `resolve` and the open."""
        path, media_type, sha = self.resolve(job, name)
        if path is None:
            return Download(None, None, media_type, sha)
        missing = errors.FileNotFound(f"file {name!r} of job {job.id} is not on disk")
        try:
            # No link (a link put in its place since is refused), and no wait on a FIFO.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError as exc:
            raise self._unreadable(path, exc) from exc
        except OSError as exc:
            raise missing from exc
        file = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not _opened_at(fd, path):
            file.close()
            raise missing
        return Download(path, file, media_type, sha)

    def _lstat(self, path: Path) -> os.stat_result | None:
        """`path`'s own status (a link's, not its target's); None if nothing is there."""
        try:
            return os.lstat(path)
        except PermissionError as exc:  # not "missing": a folder on the way the API may not enter
            raise self._unreadable(path, exc) from exc
        except OSError:  # missing, or a part of the way that is not a folder
            return None

    def _unreadable(self, path: Path, exc: OSError) -> errors.StorageError:
        """The error for a file below the root that the API's user is not allowed to read."""
        return errors.StorageError(
            f"the API's user cannot read storage/{path.relative_to(self.root)} ({exc.strerror}): "
            "give it read access to the file and the folders above it"
        )


def log_file(root: Path, job_id: uuid.UUID, attempt: int) -> Path:
    """The log of one attempt: logs/<first two hex digits of the id>/<id>.attempt-<n>.log."""
    return root / "logs" / job_id.hex[:2] / f"{job_id}.attempt-{attempt}.log"


def _opened_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the one at `path` reached through no link: a folder on the
    way replaced by a link after `resolve` looked is followed by the open (O_NOFOLLOW checks the
    last part only). A file deleted since is not (its name ends in " (deleted)"). Without /proc,
    what `resolve` saw stands."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except FileNotFoundError:
        return True


def make_folder(path: Path) -> None:
    """`path`, and the folders missing above it, each made with FOLDER_MODE (less what the umask
    takes away). `Path.mkdir(parents=True)` gives the folders above the process's default mode."""
    try:
        path.mkdir(mode=FOLDER_MODE, exist_ok=True)
    except FileNotFoundError:
        make_folder(path.parent)
        path.mkdir(mode=FOLDER_MODE, exist_ok=True)


def _close_to_others(folder: Path) -> None:
    """Take other users' access to `folder` away, if it is this user's (an earlier version made
    its folders with the umask's mode, commonly 0755); its group keeps what it had."""
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(folder)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and info.st_mode & 0o007:
            os.chmod(folder, stat.S_IMODE(info.st_mode) & ~0o007)


def _fsync(path: Path, *, mode: int | None = None) -> None:
    """Flush a file's data, or a folder's entries, to the disk; with `mode`, give it that first."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _safe_name(name: str) -> str:
    """A worker id as one folder name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def _empty(folder: Path, keep: Sequence[str | None] = ()) -> None:
    """Remove everything in `folder` but the entries named in `keep`; symlinks are removed, not
    followed. Folders the model made read-only are made writable for it (this process owns them)."""
    try:
        _empty_once(folder, keep)
    except PermissionError:
        _writable(folder)
        _empty_once(folder, keep)


def _empty_once(folder: Path, keep: Sequence[str | None]) -> None:
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name in keep:
                continue
            if entry.is_dir(follow_symlinks=False):
                _rmtree(entry.path)
            else:
                os.unlink(entry.path)


def _rmtree(path: str | Path) -> None:
    """shutil.rmtree, through folders the model made read-only (made writable first)."""
    try:
        shutil.rmtree(path)
    except PermissionError:
        _writable(Path(path))
        shutil.rmtree(path)


def _writable(top: Path) -> None:
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
