"""Deleting an expired job's files when some cannot be deleted (app/retention.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import retention

NOBODY = 65534


@pytest.fixture
def storage_root() -> Iterator[Path]:
    """A storage root others may pass through (tmp_path's parents are the test user's alone)."""
    root = Path(tempfile.mkdtemp(prefix="gpujobs-retention-"))
    root.chmod(0o755)
    yield root
    for below in root.rglob("*"):
        if below.is_dir() and not below.is_symlink():
            below.chmod(0o755)
    shutil.rmtree(root)


def delete_as_another_user(root: Path, job_id: uuid.UUID) -> tuple[int, list[str]]:
    """`_delete` by a user who may not write the job's folders: as root, in a child that becomes
    nobody (as README's API of another user than the workers'); else the folders are made read-only."""
    if os.geteuid() != 0:
        for folder in (root / "results" / str(job_id)).rglob("*"):
            folder.chmod(0o555)
        freed, problems = retention._delete(root, [job_id])
        return freed, problems
    read, write = os.pipe()
    with warnings.catch_warnings():  # fork beside the test process's threads: the child only deletes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, json.dumps(retention._delete(root, [job_id])).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    freed, problems = json.loads(said)
    return freed, problems


def test_files_that_cannot_be_deleted_are_said_and_not_counted_as_freed(storage_root: Path) -> None:
    """A prune that could not delete a job's result folder (the API running as another user than
    the workers', whose folders it may not write) reported its bytes as freed and said nothing:
    the files stayed, the job was expired, and its next sweeps counted it as removed each time."""
    job_id = uuid.uuid4()
    attempt = storage_root / "results" / str(job_id) / "1"
    attempt.mkdir(parents=True)
    (attempt / "mesh.glb").write_bytes(bytes(5000))
    for folder in (storage_root / "results", attempt.parent, attempt):
        folder.chmod(0o755)
    freed, problems = delete_as_another_user(storage_root, job_id)
    assert (attempt / "mesh.glb").exists()
    assert freed == 0
    assert len(problems) == 1 and f"results/{job_id}" in problems[0], problems


def test_files_deleted_are_counted(storage_root: Path) -> None:
    job_id = uuid.uuid4()
    attempt = storage_root / "results" / str(job_id) / "1"
    attempt.mkdir(parents=True)
    (attempt / "mesh.glb").write_bytes(bytes(5000))
    log = storage_root / "logs" / job_id.hex[:2] / f"{job_id}.attempt-1.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(bytes(300))
    assert retention._delete(storage_root, [job_id]) == (5300, [])
    assert not attempt.parent.exists() and not log.exists()


def test_storage_used_counts_a_part_linked_to_another_disk_once_in_the_total(tmp_path: Path) -> None:
    """A part of the storage folder may be a link to another disk (results on a bigger one). Its
    bytes were counted under its name, but the total walked the storage folder without following
    the link: GET /admin/stats showed a total smaller than the results alone, and `other` (the
    total less the parts, clamped at 0) hid it."""
    root, disk = tmp_path / "storage", tmp_path / "bigger-disk"
    (disk / "results" / str(uuid.uuid4())).mkdir(parents=True)
    next((disk / "results").iterdir()).joinpath("mesh.glb").write_bytes(b"x" * 100_000)
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "a.log").write_bytes(b"y" * 1_000)
    (root / "notes.txt").write_bytes(b"z" * 10)  # not a part: counted as other
    (root / "results").symlink_to(disk / "results")
    usage = retention.disk_usage(root)
    assert (usage["results"], usage["logs"], usage["other"]) == (100_000, 1_000, 10), usage
    assert usage["total"] == 101_010, usage
