"""`gpujobs check`: whether the results the database lists are on disk as they were stored.

Every succeeded job that retention has not expired names its result files in its row (name, size,
SHA-256). After a restore, a disk replaced or repaired, or files moved by hand, this reads them
back: each file must be at results/<job>/<attempt>/<name>, a regular file reached through no link
(as the download route requires), of the size stored, and with `--hash` of the digest stored. It
also lists the folders of results/ whose job the database does not have (results newer than a
restored backup, or of another installation's database). It changes nothing.

The disk is listed before the database is read: a results folder exists only once its job was
claimed, so a job queued while the check runs cannot be taken for an unknown one. A file found
missing is asked about again, in case retention expired its job meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app import db, errors, storage
from app.queue.jobs import ResultFile

PAGE = 500  # succeeded jobs read, and their files checked, at a time

KEPT_RESULTS = text(
    "SELECT id, attempt, results::text AS results FROM jobs"
    " WHERE state = 'succeeded' AND expired_at IS NULL AND results <> '[]'::jsonb AND id > :after"
    " ORDER BY id LIMIT :page"
)
STILL_KEPT = text("SELECT id FROM jobs WHERE id = ANY(:ids) AND state = 'succeeded' AND expired_at IS NULL")
KNOWN = text("SELECT id FROM jobs WHERE id = ANY(:ids)")


@dataclass(frozen=True, slots=True)
class Finding:
    """One result file that is not as its job's row says."""

    job_id: str
    name: str
    problem: str  # missing, not a file, unreadable, size, changed
    detail: str
    path: str  # below the storage folder


@dataclass(frozen=True, slots=True)
class Stray:
    """A folder of results/ whose job the database does not have."""

    path: str  # below the storage folder
    bytes: int


@dataclass(slots=True)
class Report:
    """What one check found."""

    jobs: int = 0
    files: int = 0
    bytes: int = 0
    hashed: bool = False
    findings: list[Finding] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Whether every result is as stored. Folders of unknown jobs are not damage: a backup's
        files are copied after its dump, so they hold the results of jobs that ended between."""
        return not self.findings

    def as_json(self) -> str:
        """The report as one JSON object."""
        return json.dumps({**asdict(self), "clean": self.clean}, indent=2)

    def lines(self) -> list[str]:
        """The report as text: a line per finding and stray folder, then the totals."""
        shown = [f"{f.problem}: job {f.job_id}, {f.name} ({f.path}): {f.detail}" for f in self.findings]
        shown += [
            f"unknown: {s.path} ({s.bytes} bytes): the database has no such job (left as it is)"
            for s in self.strays
        ]
        how = "sizes and SHA-256" if self.hashed else "sizes (add --hash to compare the SHA-256 too)"
        shown.append(
            f"checked {self.jobs} succeeded jobs, {self.files} files, {self.bytes} bytes, by {how}: "
            f"{len(self.findings)} not as stored, {len(self.strays)} folders of unknown jobs"
        )
        return shown


def results_root(storage_dir: Path) -> Path:
    """The real path of the storage folder's results part (it may link to another disk).
    ConfigError if there is none: a storage folder no service ever ran on, or a wrong path (where
    the embedded database would be made anew, empty, if the check went on)."""
    path = storage_dir / "results"
    if not path.is_dir():
        raise errors.ConfigError(
            f"GPUJOBS_STORAGE_DIR: {path} is not a folder: run the check on the API's host, with its "
            "settings (the storage folder it serves results from)"
        )
    return Path(os.path.realpath(path))


def check_file(
    root: Path, job_id: uuid.UUID, attempt: int, stored: ResultFile, *, hash_: bool
) -> Finding | None:
    """None if one result file is as its job's row says, else what differs."""
    path = root / str(job_id) / str(attempt) / stored.name
    shown = f"results/{job_id}/{attempt}/{stored.name}"

    def found(problem: str, detail: str) -> Finding:
        return Finding(str(job_id), stored.name, problem, detail, shown)

    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return found("missing", "not on disk")
    except OSError as exc:
        return found("unreadable", exc.strerror or str(exc))
    if not stat.S_ISREG(info.st_mode) or os.path.realpath(path) != str(path):
        return found("not a file", "a link, a folder or a device, or a link on the way: never served")
    if info.st_size != stored.bytes:
        return found("size", f"{info.st_size} bytes on disk, {stored.bytes} stored")
    if hash_:
        try:
            digest = storage.sha256_of(path)
        except OSError as exc:
            return found("unreadable", exc.strerror or str(exc))
        if digest != stored.sha256:
            return found("changed", f"SHA-256 {digest} on disk, {stored.sha256} stored")
    return None


async def kept_results(engine: AsyncEngine) -> AsyncIterator[list[Any]]:
    """The rows of succeeded, unexpired jobs with results, a page at a time, in id order."""
    after = uuid.UUID(int=0)
    while rows := await db.fetch_rows(engine, KEPT_RESULTS, {"after": after, "page": PAGE}):
        yield rows
        after = rows[-1]["id"]


def _check_page(root: Path, rows: Iterable[Any], hash_: bool, report: Report) -> list[Finding]:
    findings = []
    for row in rows:
        report.jobs += 1
        for data in json.loads(row["results"]):
            stored = ResultFile.from_json(data)
            report.files += 1
            report.bytes += stored.bytes
            if (finding := check_file(root, row["id"], row["attempt"], stored, hash_=hash_)) is not None:
                findings.append(finding)
    return findings


def _folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def _job_folders(root: Path) -> list[uuid.UUID]:
    """The ids named by the folders of results/ (its hidden probes and anything else left out)."""
    ids = []
    with os.scandir(root) as entries:
        for entry in entries:
            try:
                ids.append(uuid.UUID(entry.name))
            except ValueError:
                continue
    return ids


async def run(engine: AsyncEngine, root: Path, *, hash_: bool = False) -> Report:
    """Check every kept result of the database at `engine` against the results folder `root`
    (`results_root`)."""
    report = Report(hashed=hash_)
    on_disk = await asyncio.to_thread(_job_folders, root)  # before the database: see the module's text
    async for rows in kept_results(engine):
        findings = await asyncio.to_thread(_check_page, root, rows, hash_, report)
        missing = [uuid.UUID(f.job_id) for f in findings if f.problem == "missing"]
        if missing:  # retention may have expired a job since its page was read
            kept = {row["id"] for row in await db.fetch_rows(engine, STILL_KEPT, {"ids": missing})}
            findings = [f for f in findings if f.problem != "missing" or uuid.UUID(f.job_id) in kept]
        report.findings += findings
    for start in range(0, len(on_disk), PAGE):
        chunk = on_disk[start : start + PAGE]
        known = {row["id"] for row in await db.fetch_rows(engine, KNOWN, {"ids": chunk})}
        for job_id in sorted(set(chunk) - known, key=str):
            size = await asyncio.to_thread(_folder_bytes, root / str(job_id))
            report.strays.append(Stray(f"results/{job_id}", size))
    return report
