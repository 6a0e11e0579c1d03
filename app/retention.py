"""Retention: finished jobs older than a set age lose their result files, logs and unused inputs.

The job row stays, with `expired_at` set, so its links answer 410 Gone. The order of the work makes
a crash harmless: a batch is marked expired (and inputs that no unexpired job uses are deleted) in
one transaction, then the batch's folders are deleted; folders of expired jobs left by a crash in
between are swept by the next run. Queued, scheduled and running jobs never match, and an expired
job cannot be retried, so nothing deleted here is needed again. An upload of an image whose last
job is expiring either keeps that image (retention waits for the new job, and sees it) or stores it
again (the upload waits for retention's transaction): see `sql.ENQUEUE` and `sql.LOCK_INPUTS`.

One process prunes at a time (a PostgreSQL advisory lock): every worker runs `run_forever`, and
`gpujobs prune` / `POST /admin/prune` call `prune` on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Final

from app import db, errors, storage
from app.queue import manager as manager_
from app.queue import sql

log = logging.getLogger("gpujobs.retention")

PARTS: Final = ("results", "logs", "scratch")  # per-job folders below the storage root
REPORTED_IDS: Final = 1000  # a report lists at most this many job ids


@dataclass(slots=True)
class PruneReport:
    """What one prune did (or, in a dry run, would do)."""

    cutoff: datetime
    dry_run: bool
    jobs: int = 0
    files_bytes: int = 0
    inputs_deleted: int | None = 0  # None in a dry run: not estimated
    inputs_bytes: int = 0
    leftovers_removed: int = 0
    job_ids: list[uuid.UUID] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what could not be deleted, and why


def tree_bytes(path: Path, *, leave_out: Collection[str] = ()) -> int:
    """Bytes of the regular files below `path` (0 if it does not exist; links below it are not
    followed), less the entries of `path` itself named in `leave_out`."""
    total = 0
    stack = [path]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if folder is path and entry.name in leave_out:
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


def disk_usage(root: Path) -> dict[str, int]:
    """Bytes used below the storage root: each part, the embedded database, the rest, and the total."""
    named = (*PARTS, "pgdata")
    # A part may be a link to another disk (results on a bigger one): measured through it, and
    # counted once in the total, which walking the root without following links left it out of.
    usage = {part: tree_bytes(root / part) for part in named}
    usage["other"] = tree_bytes(root, leave_out=named)
    usage["total"] = sum(usage.values())
    return usage


def disk_space(root: Path) -> dict[str, tuple[int, int]]:
    """(size, free bytes) of the file system of each part of the storage root that exists, the
    embedded database's folder included: each may be a mount of its own. Free is what an
    unprivileged writer may still use (`statvfs`'s f_bavail), as `df` shows it. One call per part,
    microseconds each: read on every scrape."""
    space: dict[str, tuple[int, int]] = {}
    for part in (*PARTS, "pgdata"):
        with contextlib.suppress(OSError):  # not made yet, or an external database (no pgdata)
            size, _used, free = shutil.disk_usage(root / part)
            space[part] = (size, free)
    return space


def job_files(root: Path, job_ids: Collection[uuid.UUID]) -> list[Path]:
    """The folders and files that hold these jobs' files: result folders, log files (one scan of
    each log folder involved), and the per-job folders of earlier versions (logs, scratch)."""
    paths = [root / part / str(job_id) for job_id in job_ids for part in PARTS]
    wanted = {str(job_id) for job_id in job_ids}
    for bucket in sorted({job_id.hex[:2] for job_id in job_ids}):
        with contextlib.suppress(OSError), os.scandir(root / "logs" / bucket) as entries:
            paths += [
                Path(entry.path)
                for entry in entries
                if (match := storage.LOG_FILE.match(entry.name)) and match[1] in wanted
            ]
    return paths


def paths_bytes(paths: Iterable[Path]) -> int:
    """Bytes of these files and of the regular files below these folders (links not followed)."""
    total = 0
    for path in paths:
        if path.is_symlink():
            continue
        if path.is_dir():
            total += tree_bytes(path)
        else:
            with contextlib.suppress(OSError):
                total += path.stat().st_size
    return total


def _files_bytes(root: Path, job_ids: Collection[uuid.UUID]) -> int:
    return paths_bytes(job_files(root, job_ids))


def _delete(root: Path, job_ids: Collection[uuid.UUID]) -> tuple[int, list[str]]:
    """Remove the jobs' files (a link in their place is left alone): the bytes freed, and why each
    path that stays could not be removed (a folder the process may not write, say)."""
    paths = job_files(root, job_ids)
    before = paths_bytes(paths)
    problems = [problem for path in paths if (problem := _remove(path, root)) is not None]
    return before - (paths_bytes(paths) if problems else 0), problems  # all gone, but for links


def _on_disk(root: Path, job_id: uuid.UUID) -> bool:
    """Whether any of the job's files or folders is still there (a link in their place aside)."""
    return any(p.exists() and not p.is_symlink() for p in job_files(root, [job_id]))


def _remove(path: Path, root: Path) -> str | None:
    """Remove one job's folder or file; None once it is gone, else why it is not."""
    if path.is_symlink():
        return None
    try:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)  # as much as it may, then the first refusal
            if path.exists():
                shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"storage/{path.relative_to(root)}: {exc.strerror or exc} ({exc.filename})"
    return None


def _jobs_on_disk(root: Path) -> list[uuid.UUID]:
    """Every job id that has a folder or a log below the storage root."""
    found: set[uuid.UUID] = set()
    for part in PARTS:
        folder = root / part
        with os.scandir(folder) if folder.is_dir() else contextlib.nullcontext(iter(())) as entries:
            for entry in entries:
                with contextlib.suppress(ValueError):
                    found.add(uuid.UUID(entry.name))
    with contextlib.suppress(OSError), os.scandir(root / "logs") as buckets:
        for bucket in buckets:
            if len(bucket.name) == 2 and bucket.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError), os.scandir(bucket.path) as entries:
                    found.update(uuid.UUID(m[1]) for e in entries if (m := storage.LOG_FILE.match(e.name)))
    return sorted(found)


class Pruner:
    """Deletes the files of old finished jobs, one process at a time."""

    def __init__(self, manager: manager_.JobManager, root: Path, *, batch: int = 500) -> None:
        self._manager = manager
        self._root = root.resolve()
        self._batch = batch
        self._pruning = False  # a prune of this process holds the lock (for the Conflict's words)

    async def prune(self, *, older_than_s: float, dry_run: bool = False) -> PruneReport:
        """Expire the jobs that finished more than `older_than_s` ago; Conflict if a prune is running."""
        # By the database's clock, which wrote `finished_at`: a host's clock may run ahead.
        cutoff = await self._manager.now() - timedelta(seconds=older_than_s)
        report = PruneReport(cutoff=cutoff, dry_run=dry_run)
        async with self._manager.advisory_lock(sql.RETENTION_LOCK_KEY) as held:
            if not held:
                where = "in this process" if self._pruning else "in another process"
                raise errors.Conflict(f"a prune is already running {where}; try again later")
            self._pruning = True
            try:
                if dry_run:
                    await self._estimate(report)
                else:
                    await self._expire_all(report)
                    await self._sweep(report)
            finally:
                self._pruning = False
        if report.problems:
            log.warning(
                "could not delete %d of the expired jobs' files or folders (first: %s); they stay until "
                "a prune can: give this process write access to the storage folder's results and logs",
                len(report.problems),
                report.problems[0],
                extra={"action": "retention_files_left", "paths": len(report.problems)},
            )
        if not dry_run and (report.jobs or report.leftovers_removed):
            log.info(
                "pruned %d jobs",
                report.jobs,
                extra={
                    "action": "retention_pruned",
                    "jobs": report.jobs,
                    "bytes_freed": report.files_bytes + report.inputs_bytes,
                    "inputs_deleted": report.inputs_deleted,
                },
            )
        return report

    async def _estimate(self, report: PruneReport) -> None:
        ids = await self._manager.expiry.expirable(cutoff=report.cutoff, limit=1_000_000)
        report.jobs, report.inputs_deleted = len(ids), None
        report.job_ids = ids[:REPORTED_IDS]
        for start in range(0, len(ids), self._batch):
            batch = ids[start : start + self._batch]
            report.files_bytes += await asyncio.to_thread(_files_bytes, self._root, batch)
        async for expired in self._leftovers():  # what the sweep would remove
            report.files_bytes += await asyncio.to_thread(_files_bytes, self._root, expired)
            report.leftovers_removed += len(expired)

    async def _expire_all(self, report: PruneReport) -> None:
        while True:
            batch = await self._manager.expiry.expire(cutoff=report.cutoff, limit=self._batch)
            freed, problems = await asyncio.to_thread(_delete, self._root, batch.job_ids)
            report.files_bytes += freed
            report.problems += problems
            report.jobs += len(batch.job_ids)
            report.inputs_deleted = (report.inputs_deleted or 0) + batch.inputs_deleted
            report.inputs_bytes += batch.input_bytes
            room = REPORTED_IDS - len(report.job_ids)
            report.job_ids.extend(batch.job_ids[: max(room, 0)])
            if len(batch.job_ids) < self._batch:
                return

    async def _leftovers(self) -> AsyncIterator[list[uuid.UUID]]:
        """Jobs already expired whose files are still on disk (a crash came between marking and
        deleting, or an earlier prune could not delete them), in batches."""
        listed = await asyncio.to_thread(_jobs_on_disk, self._root)
        for start in range(0, len(listed), 1000):
            if expired := await self._manager.expiry.expired_among(listed[start : start + 1000]):
                yield list(expired)

    async def _sweep(self, report: PruneReport) -> None:
        """Delete the leftovers' files; count the jobs whose files are now all gone."""
        async for expired in self._leftovers():
            freed, problems = await asyncio.to_thread(_delete, self._root, expired)
            report.files_bytes += freed
            report.problems += problems
            if problems:
                expired = [job_id for job_id in expired if not _on_disk(self._root, job_id)]
            report.leftovers_removed += len(expired)

    async def run_forever(self, *, older_than_s: float, interval_s: float) -> None:
        """Prune every `interval_s` (skipped while another process prunes); never raises but cancel."""
        while True:
            try:
                await self.prune(older_than_s=older_than_s)
            except errors.Conflict:
                pass  # another worker is on it
            except Exception as exc:
                level = logging.WARNING if db.is_unavailable(exc) else logging.ERROR
                log.log(level, "retention run failed: %s", exc, extra={"action": "retention_failed"})
            await asyncio.sleep(interval_s)


class DiskUsage:
    """Disk usage of the storage root, measured at most every `ttl_s` (walking a big tree takes time)."""

    def __init__(self, root: Path, *, ttl_s: float = 60.0) -> None:
        self._root = root
        self._ttl_s = ttl_s
        self._lock = asyncio.Lock()
        self._measured: tuple[float, dict[str, int]] | None = None

    async def read(self) -> dict[str, int]:
        """Bytes per part of storage/ (see `disk_usage`)."""
        async with self._lock:
            now = asyncio.get_running_loop().time()
            if self._measured is None or now - self._measured[0] >= self._ttl_s:
                self._measured = (now, await asyncio.to_thread(disk_usage, self._root))
            return dict(self._measured[1])
