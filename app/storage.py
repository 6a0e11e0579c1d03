"""ResultStore: the files under storage/ — scratch space, per-attempt logs, published results.

Layout (all below one root):

    scratch/<job id>/<attempt>/          input image and the model's output folder, while it runs
    results/<job id>/<attempt>/<name>    published outputs of the attempt that succeeded
    logs/<job id>/attempt-<n>.log        stdout and stderr of each attempt

Results appear only complete: outputs are moved into a hidden folder, then that folder is renamed
into place (one atomic rename). A crash leaves at most a scratch folder or an unreferenced
attempt folder behind, which `sweep()` removes.
"""

from __future__ import annotations

import hashlib
import mimetypes
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
        for part in ("scratch", "results", "logs"):
            (self.root / part).mkdir(parents=True, exist_ok=True)

    def scratch_dir(self, job_id: uuid.UUID, attempt: int) -> Path:
        """A fresh, empty scratch folder for one attempt, with an `out/` folder inside."""
        path = self.root / "scratch" / str(job_id) / str(attempt)
        shutil.rmtree(path, ignore_errors=True)
        (path / "out").mkdir(parents=True)
        return path

    def log_path(self, job_id: uuid.UUID, attempt: int) -> Path:
        """Where an attempt's log goes."""
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

    def drop_scratch(self, job_id: uuid.UUID, attempt: int | None = None) -> None:
        """Remove an attempt's scratch folder (or all of the job's)."""
        path = self.root / "scratch" / str(job_id)
        shutil.rmtree(path if attempt is None else path / str(attempt), ignore_errors=True)
        if attempt is not None and path.is_dir() and not any(path.iterdir()):
            path.rmdir()

    def sweep(self, keep: Iterable[tuple[uuid.UUID, int]]) -> int:
        """Remove scratch folders of every attempt not in `keep` (dead attempts); returns how many."""
        alive = {(str(j), str(a)) for j, a in keep}
        removed = 0
        for job_dir in (self.root / "scratch").iterdir():
            for attempt_dir in list(job_dir.iterdir()) if job_dir.is_dir() else []:
                if (job_dir.name, attempt_dir.name) not in alive:
                    shutil.rmtree(attempt_dir, ignore_errors=True)
                    removed += 1
            if job_dir.is_dir() and not any(job_dir.iterdir()):
                job_dir.rmdir()
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


def media_type_for(name: str) -> str:
    """A media type from a file name, for outputs the registry does not describe."""
    guessed, _ = mimetypes.guess_type(name)
    return guessed or "application/octet-stream"
