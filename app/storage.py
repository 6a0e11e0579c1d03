"""ResultStore: the files under storage/ — scratch space, per-attempt logs, published results.

Layout (all below one root):

    scratch/<worker>/<lane>/             input image and the model's output folder, while it runs
                                         (a worker's lanes are reused job after job, emptied
                                         between: `ResultStore.lanes`, app/lanes.py)
    results/<job id>/<attempt>/<name>    published outputs of the attempt that succeeded
    logs/<xy>/<job id>.attempt-<n>.log   stdout and stderr of each attempt (<xy>: the id's first
                                         two hex digits, at most 256 folders, each made with the
                                         first log in it; logs/<job id>/attempt-<n>.log of
                                         earlier versions are still served and pruned)

Results appear only complete: outputs are moved into a hidden folder, then that folder is renamed
into place (one atomic rename). A crash leaves at most a lane's files, which the worker removes
when it starts again (`lanes.Lanes.reset`), or an unreferenced attempt folder, which the job's end
removes (`drop_attempts`): a later attempt's success, or its failure, cancel or quarantine. A
worker that stops removes its lanes too.

Modes: what the service makes below the root is closed to other users, whatever the umask allows
(app/folders.py). The group may read, as an API running as another user of the workers' group must
(results, logs). The folders below the root that an earlier version left open to others are closed
at the start.
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

from app import errors, folders, lanes
from app.queue.jobs import Job, ResultFile

LOG_NAME = re.compile(r"attempt-([1-9][0-9]{0,5})\.log\Z")  # as links name logs (\Z: no final line break)
ATTEMPT_DIR = re.compile(r"([1-9][0-9]{0,8})\Z|\.([1-9][0-9]{0,8})\.partial\Z")  # results/<job>/ entries
LOG_FILE = re.compile(r"^([0-9a-f-]{36})\.attempt-[1-9][0-9]{0,5}\.log$")  # as logs are stored
PROBE_BYTES = 1 << 20  # what `probe` asks of the disk: room for a small job's input and outputs
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


class OutputMissing(OutputInvalid):
    """A required output was not written, or is empty: what a model's writes to a full disk leave,
    so the verdict asks whether the disk was full (app/queue/verdict.py) before blaming the job."""


@dataclass(frozen=True, slots=True)
class FoundOutput:
    """A declared output the model wrote, staged and checked but for its hash (ResultStore.stage)."""

    spec: ExpectedOutput
    path: Path
    size: int


def hash_outputs(found: Sequence[FoundOutput]) -> list[ResultFile]:
    """The outputs found, described with their SHA-256 (which reads each whole)."""
    return [ResultFile(f.spec.name, f.size, sha256_of(f.path), f.spec.media_type) for f in found]


def sha256_of(path: Path) -> str:
    """The file's SHA-256, in hex, read a megabyte at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _staged(out_dir: Path, staging: Path, spec: ExpectedOutput) -> FoundOutput | None:
    """Move one declared output into `staging` and check it there; None for an optional output the
    model did not write. (A link is moved as a link, and refused: never followed.)"""
    path = staging / spec.name
    try:
        os.rename(out_dir / spec.name, path)
        info: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode):
        if info is not None:  # a link, a folder, a FIFO: not an output
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(info.st_mode):
                    folders.remove_tree(path)
                else:
                    os.unlink(path)
        if spec.required:
            raise (OutputInvalid if info else OutputMissing)(f"output {spec.name!r} {_not_a_file(info)}")
        return None
    if info.st_nlink > 1:  # a second name elsewhere: whoever holds it could change the file served
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise OutputInvalid(
            f"output {spec.name!r} is a hard link (the file has {info.st_nlink} names): the run must "
            "write its outputs, or copy them, into its output folder"
        )
    if info.st_size == 0:
        raise OutputMissing(f"output {spec.name!r} is empty")
    if info.st_size > spec.max_bytes:
        raise OutputInvalid(f"output {spec.name!r} is {info.st_size} bytes, over the {spec.max_bytes} cap")
    return FoundOutput(spec, path, info.st_size)


def _not_a_file(info: os.stat_result | None) -> str:
    """Why a declared output is not one, in words."""
    if info is None:
        return "was not written"
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link, not a file (links are never followed)"
    return "is a folder, not a file" if stat.S_ISDIR(info.st_mode) else "is not a regular file"


def full_disk_line(text: str) -> str | None:
    """The last line of `text` (a run's last words) that names a full disk, stripped; None if none."""
    found = [line.strip() for line in text.splitlines() if FULL_DISK.search(line)]
    return found[-1] if found else None


def unusable(path: Path, exc: OSError, reason: str | None = None) -> errors.ConfigError:
    """The error for a path under the storage folder that cannot be used, naming the setting."""
    return errors.ConfigError(f"GPUJOBS_STORAGE_DIR: cannot use {path}: {reason or exc.strerror or exc}")


def _temp_prefix(worker_id: str) -> str:
    """How the names of a worker's runners' temporary folders begin (a worker id as a name)."""
    return f"tmp-{hashlib.sha256(worker_id.encode()).hexdigest()[:12]}-"


class ResultStore:
    """Paths and atomic moves below the storage root."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._made: set[Path] = set()  # runner folders known to exist
        self._new_jobs: set[uuid.UUID] = set()  # jobs whose results folder `stage` made: flushed at `publish`
        # Each part's real path, read once: a part may be a link to another disk (results on a
        # bigger one). Every path below is made from these, so a link below a part (results/<job>
        # linked elsewhere) still makes a real path differ from its path, and is refused.
        real = {part: self._part(part) for part in PARTS}
        self._results, self._logs, self._runners = real["results"], real["logs"], real["runners"]
        self.lanes = lanes.Lanes(real["scratch"])

    def _part(self, part: str) -> Path:
        """The folder `part` below the root, made if missing (but `runners`, made with the first
        warm runner) and closed to others: its real path. ConfigError for a file in the way, a link
        to no folder, or a folder this user cannot write."""
        folder = self.root / part
        try:
            if part != "runners":
                folders.make_folder(folder)
            real = Path(os.path.realpath(folder))
            folders.close_to_others(real)
        except OSError as exc:
            reason = "not a folder" if isinstance(exc, FileExistsError) else None
            if os.path.islink(folder):
                reason = (
                    f"a link to {os.path.realpath(folder)}, which is not a folder: make that folder, or "
                    "replace the link"
                )
            raise unusable(folder, exc, reason) from exc
        return real

    def probe(self, owner: str) -> None:
        """OSError unless `owner`'s scratch folder takes a file of PROBE_BYTES and the results
        folder a new folder: a full disk, a folder gone read-only or removed fails it."""
        scratch = self.lanes.folder(owner)
        folders.make_folder(scratch)
        with tempfile.TemporaryFile(dir=scratch) as f:  # nameless (O_TMPFILE): a crash leaves nothing
            os.posix_fallocate(f.fileno(), 0, PROBE_BYTES)
        with tempfile.TemporaryDirectory(prefix=".probe-", dir=self._results):
            pass

    def runner_dir(self, model: str, gpu: int | None) -> Path:
        """The folder of a model's warm runners on a GPU: their log, and each one's own folder."""
        path = self._runners / f"{model}-gpu{'none' if gpu is None else gpu}"
        if path not in self._made:  # asked for on every warm job: made once
            folders.make_folder(path)
            self._made.add(path)
        return path

    def runner_temp(self, folder: Path, worker_id: str) -> Path:
        """A new folder for one warm runner (its HOME, working folder and TMPDIR) in its runner
        `folder`, which warm.py removes as the runner ends (several runners share `folder`)."""
        return Path(tempfile.mkdtemp(prefix=_temp_prefix(worker_id), dir=folder))

    def drop_runner_temps(self, worker_id: str) -> None:
        """Remove the runners' temporary folders a previous life of `worker_id` left (killed with
        it, they were never removed), in every runner folder: at its start, before any runner."""
        for stale in self._runners.glob(f"*/{_temp_prefix(worker_id)}*"):
            folders.remove_quietly(stale)

    def log_path(self, job_id: uuid.UUID, attempt: int) -> Path:
        """Where an attempt's log goes (nothing is made: the log is made once its model prints,
        app/runlog.py)."""
        return log_in(self._logs, job_id, attempt)

    def stage(
        self, job_id: uuid.UUID, attempt: int, out_dir: Path, expected: Sequence[ExpectedOutput]
    ) -> list[FoundOutput]:
        """Move the declared outputs out of `out_dir` into the attempt's hidden staging folder,
        then check them there: not a link, not empty, not too large (`hash_outputs` then
        describes them whole, `publish` puts them in place). Checked and hashed in `out_dir`, an
        output could be replaced by path (by a process the run left behind) between its hash and
        its publishing, so the file served did not match its sha256; moved first (one rename each,
        and no folder made for a job that wrote none), it is what its hash says. OutputInvalid if one is
        missing, empty or too large, or if the output folder itself was replaced (a link to
        elsewhere is never followed); nothing stays staged then. StorageError if the staging
        folder cannot be made."""
        if out_dir.is_symlink() or not out_dir.is_dir():
            raise OutputInvalid("the output folder was replaced by the model: it is not a folder")
        for spec in expected:
            if spec.required and not os.path.lexists(out_dir / spec.name):
                raise OutputMissing(f"output {spec.name!r} was not written")
        written = [spec for spec in expected if os.path.lexists(out_dir / spec.name)]
        if not written:  # no folder made and removed for nothing (as for /bin/true)
            return []
        staging = self._staging(job_id, attempt)
        try:
            if not staging.parent.is_dir():
                self._new_jobs.add(job_id)
            shutil.rmtree(staging, ignore_errors=True)
            folders.make_folder(staging)
        except OSError as exc:
            raise errors.StorageError(f"could not stage results of job {job_id}: {exc}") from exc
        try:
            staged = [found for spec in written if (found := _staged(out_dir, staging, spec)) is not None]
        except BaseException:
            self.unstage(job_id, attempt)
            raise
        if not staged:  # optional outputs only, none a file: nothing to publish
            self.unstage(job_id, attempt)
        return staged

    def _staging(self, job_id: uuid.UUID, attempt: int) -> Path:
        """The hidden folder an attempt's outputs are gathered in before they are put in place."""
        return self._results / str(job_id) / f".{attempt}.partial"

    def publish(self, job_id: uuid.UUID, attempt: int, files: Iterable[ResultFile]) -> Path:
        """Put the staged outputs (`stage`) in place: results/<job>/<attempt>/, in one atomic rename.

        Files and folders are on disk (fsync) before this returns, so the success written next
        never names files that a crash of the host would leave empty or missing. Each file gets
        folders.FILE_MODE, whatever mode its model gave it."""
        final = self._results / str(job_id) / str(attempt)
        staging = self._staging(job_id, attempt)
        new_job = job_id in self._new_jobs
        self._new_jobs.discard(job_id)
        try:
            for f in files:
                folders.fsync(staging / f.name, mode=folders.FILE_MODE)
            folders.fsync(staging)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            folders.fsync(final.parent)
            if new_job:
                folders.fsync(final.parent.parent)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise errors.StorageError(f"could not publish results of job {job_id}: {exc}") from exc
        return final

    def unstage(self, job_id: uuid.UUID, attempt: int) -> None:
        """Remove an attempt's staged outputs that will not be published."""
        self._new_jobs.discard(job_id)
        shutil.rmtree(self._staging(job_id, attempt), ignore_errors=True)

    def unpublish(self, job_id: uuid.UUID, attempt: int) -> None:
        """Remove an attempt's published results (its completion lost to fencing)."""
        shutil.rmtree(self._results / str(job_id) / str(attempt), ignore_errors=True)

    def drop_attempts(self, job_id: uuid.UUID, *, upto: int) -> None:
        """Remove the result folders, whole or hidden, of attempts 1 to `upto` of a job that ended:
        at attempt `upto` without success, or at `upto` + 1 with it. A worker that died while
        storing them left them. None of those attempts can ever win the fenced success; a later
        one (after an admin retry) may be storing its results now, and is left alone."""
        folder = self._results / str(job_id)
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                found = ATTEMPT_DIR.match(entry.name)
                if found and int(found.group(1) or found.group(2)) <= upto:
                    with contextlib.suppress(OSError):
                        folders.remove_tree(entry.path)

    def resolve(self, job: Job, name: str) -> tuple[Path | None, str, str | None]:
        """The file a link names: (path, media type, sha256 or None). Names come from the job row.

        The path is None for the log of an attempt that has none: its model has printed nothing
        (yet) and the run did not end badly (app/runlog.py). That log is empty, not missing."""
        result = job.result(name)
        if result is not None:
            path = self._results / str(job.id) / str(job.attempt) / result.name
            media_type, sha = result.media_type, result.sha256
        elif (match := LOG_NAME.match(name)) and 1 <= int(match.group(1)) <= job.attempt:
            path = self.log_path(job.id, int(match.group(1)))
            if self._lstat(path) is None:  # written by an earlier version: one folder per job
                path = self._logs / str(job.id) / name
            media_type, sha = "text/plain; charset=utf-8", None
            if self._lstat(path) is None:  # nothing there, not even a link (refused below)
                return None, media_type, sha
        else:
            raise errors.FileNotFound(f"job {job.id} has no file {name!r}")
        # A link anywhere on the way (the file, or a folder: results/<job> linked to another job's)
        # makes the real path differ; the root and its parts are resolved (a part may be a link to
        # another disk: __init__), so a path without links below them is its own.
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
        parts = {"results": self._results, "logs": self._logs}  # the parts' real paths
        shown = next(
            (
                f"storage/{name}/{path.relative_to(real)}"
                for name, real in parts.items()
                if path.is_relative_to(real)
            ),
            str(path),
        )
        return errors.StorageError(
            f"the API's user cannot read {shown} ({exc.strerror}): "
            "give it read access to the file and the folders above it"
        )


def log_file(root: Path, job_id: uuid.UUID, attempt: int) -> Path:
    """The log of one attempt: logs/<first two hex digits of the id>/<id>.attempt-<n>.log."""
    return log_in(root / "logs", job_id, attempt)


def log_in(logs: Path, job_id: uuid.UUID, attempt: int) -> Path:
    """The log of one attempt in the folder `logs` (see `log_file`)."""
    return logs / job_id.hex[:2] / f"{job_id}.attempt-{attempt}.log"


def _opened_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the one at `path` reached through no link: a folder on the
    way replaced by a link after `resolve` looked is followed by the open (O_NOFOLLOW checks the
    last part only). A file deleted since is not (its name ends in " (deleted)"). Without /proc,
    what `resolve` saw stands."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except FileNotFoundError:
        return True
