"""ResultStore: the files under storage/ — scratch space, per-attempt logs, published results.

Layout (all below one root):

    scratch/<job id>.<attempt>/          input image and the model's output folder, while it runs
    results/<job id>/<attempt>/<name>    published outputs of the attempt that succeeded
    logs/<job id>/attempt-<n>.log        stdout and stderr of each attempt

Results appear only complete: outputs are moved into a hidden folder, then that folder is renamed
into place (one atomic rename). A crash leaves at most a scratch folder or an unreferenced
attempt folder behind, which `sweep()` removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app import errors
from app.queue.jobs import Job, ResultFile

LOG_NAME = re.compile(r"^attempt-([1-9][0-9]{0,5})\.log$")


@dataclass(frozen=True, slots=True)
class ExpectedOutput:
    """A file the model must (or may) write, with its media type and size cap."""

    name: str
    media_type: str
    required: bool = True
    max_bytes: int = 512 * 1024 * 1024


class OutputInvalid(errors.AppError):
    """The model exited 0 but its outputs are missing, empty or too large."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ResultStore:
    """Paths and atomic moves below the storage root."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._runner_dirs: set[Path] = set()
        for part in ("scratch", "results", "logs"):
            (self.root / part).mkdir(parents=True, exist_ok=True)

    def scratch_path(self, job_id: uuid.UUID, attempt: int) -> Path:
        """Where one attempt's scratch folder is (flat: one folder per attempt, nothing above it)."""
        return self.root / "scratch" / f"{job_id}.{attempt}"

    def scratch_dir(self, job_id: uuid.UUID, attempt: int) -> Path:
        """A fresh, empty scratch folder for one attempt, with an `out/` folder inside."""
        path = self.scratch_path(job_id, attempt)
        try:
            path.mkdir()
        except FileExistsError:  # left by an earlier life of this attempt
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
        (path / "out").mkdir()
        return path

    def prepare(self, job_id: uuid.UUID, attempt: int, input_name: str, data: bytes) -> tuple[Path, Path]:
        """Everything an attempt needs on disk before its model starts, in one call (the worker runs
        it in a thread): the scratch folder with the input image in it, and the log's folder.
        Returns (scratch folder, log path)."""
        scratch = self.scratch_dir(job_id, attempt)
        fd = os.open(scratch / input_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return scratch, self.log_path(job_id, attempt)

    def runner_dir(self, model: str, gpu: int | None) -> Path:
        """The working folder of a warm runner (its HOME and its own log)."""
        path = self.root / "runners" / f"{model}-gpu{'none' if gpu is None else gpu}"
        if path not in self._runner_dirs:  # asked for on every warm job: made once
            path.mkdir(parents=True, exist_ok=True)
            self._runner_dirs.add(path)
        return path

    def log_path(self, job_id: uuid.UUID, attempt: int) -> Path:
        """Where an attempt's log goes (its folder is made)."""
        path = self.root / "logs" / str(job_id) / f"attempt-{attempt}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def check_outputs(self, out_dir: Path, expected: Sequence[ExpectedOutput]) -> list[ResultFile]:
        """Describe the declared outputs; OutputInvalid if one is missing, empty or too large."""
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
            found.append(ResultFile(spec.name, size, _sha256(path), spec.media_type))
        return found

    def publish(self, job_id: uuid.UUID, attempt: int, out_dir: Path, files: Iterable[ResultFile]) -> Path:
        """Move the outputs into results/<job>/<attempt>/ in one atomic rename."""
        final = self.root / "results" / str(job_id) / str(attempt)
        staging = final.parent / f".{attempt}.partial"
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            for f in files:
                os.replace(out_dir / f.name, staging / f.name)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise errors.StorageError(f"could not publish results of job {job_id}: {exc}") from exc
        return final

    def unpublish(self, job_id: uuid.UUID, attempt: int) -> None:
        """Remove an attempt's published results (its completion lost to fencing)."""
        shutil.rmtree(self.root / "results" / str(job_id) / str(attempt), ignore_errors=True)

    def drop_scratch(self, job_id: uuid.UUID, attempt: int) -> None:
        """Remove an attempt's scratch folder."""
        shutil.rmtree(self.scratch_path(job_id, attempt), ignore_errors=True)

    def scratch_attempts(self) -> list[tuple[uuid.UUID, int]]:
        """Every (job id, attempt) that has a scratch folder now."""
        found = []
        for entry in _listing(self.root / "scratch"):
            job_id, _, attempt = entry.name.partition(".")
            with contextlib.suppress(ValueError):
                found.append((uuid.UUID(job_id), int(attempt)))
        return found

    def sweep(
        self, candidates: Iterable[tuple[uuid.UUID, int]], alive: Iterable[tuple[uuid.UUID, int]]
    ) -> int:
        """Remove the scratch folders of `candidates` that are not `alive`; returns how many.

        Safe while other workers share the folder: list the candidates first, then ask the database
        which attempts run; a folder is only made after its claim committed, so a running attempt
        listed before the query is in its answer. Folders vanishing under us are fine.
        """
        running = set(alive)
        removed = 0
        for job_id, attempt in candidates:
            if (job_id, attempt) not in running:
                self.drop_scratch(job_id, attempt)
                removed += 1
        return removed

    def resolve(self, job: Job, name: str) -> tuple[Path, str, str | None]:
        """The file a link names: (path, media type, sha256 or None). Names come from the job row."""
        result = job.result(name)
        if result is not None:
            path = self.root / "results" / str(job.id) / str(job.attempt) / result.name
            media_type, sha = result.media_type, result.sha256
        elif (match := LOG_NAME.match(name)) and 1 <= int(match.group(1)) <= job.attempt:
            path = self.root / "logs" / str(job.id) / name
            media_type, sha = "text/plain; charset=utf-8", None
        else:
            raise errors.FileNotFound(f"job {job.id} has no file {name!r}")
        if path.is_symlink() or not path.resolve().is_relative_to(self.root) or not path.is_file():
            raise errors.FileNotFound(f"file {name!r} of job {job.id} is not on disk")
        return path, media_type, sha


def _listing(folder: Path) -> list[Path]:
    """The entries of a folder that another process may be removing (missing = empty)."""
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
