"""What the service writes below storage/ is closed to other local users: folders 0750, files
0640 (the API may run as another user of the workers' group and reads results and logs)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import storage
from app.queue.jobs import JobState
from app.settings import Settings
from tests.conftest import api_client
from tests.integration.test_worker import enqueue


@contextlib.contextmanager
def usual_umask() -> Iterator[None]:
    """The umask most services start with (022), under which every file was readable by all."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """The permission bits of everything below `root`, by path relative to it."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}


def open_to_others(found: dict[str, int]) -> dict[str, str]:
    """Those of `found` that another user (not the owner, not of its group) may use."""
    return {path: oct(mode) for path, mode in found.items() if mode & 0o007}


async def until_exists(pattern: str, root: Path, timeout_s: float = 10) -> Path:
    """The first path below `root` that matches `pattern`, once there is one."""
    deadline = time.monotonic() + timeout_s
    while not (found := await asyncio.to_thread(lambda: sorted(root.rglob(pattern)))):
        assert time.monotonic() < deadline, f"nothing matched {pattern}"
        await asyncio.sleep(0.02)
    return found[0]


async def test_a_jobs_files_and_folders_are_closed_to_other_users(
    manager: Any, make_worker: Any, store: storage.ResultStore
) -> None:
    """Under umask 022, results, logs, the scratch lane and the folders holding them were made
    0644 and 0755: every local user could read every user's results and input images."""
    job_id = await enqueue(manager, sleep=1.0, noise_kb=1)  # it prints, so its attempt has a log
    with usual_umask():
        run = asyncio.create_task(make_worker().run())
        await until_exists("input.*", store.root / "scratch")
        while_running = modes(store.root)
        await run
    assert open_to_others(while_running) == {}
    lane = next(p for p in while_running if p.startswith("scratch/") and p.endswith("/out"))
    assert while_running[lane] == while_running[str(Path(lane).parent)] == 0o750

    after = modes(store.root)
    assert open_to_others(after) == {}
    result, log = f"results/{job_id}/1", f"logs/{job_id.hex[:2]}"
    assert after[f"{result}/out.txt"] == after[f"{log}/{job_id}.attempt-1.log"] == 0o640
    assert after[f"results/{job_id}"] == after[result] == after[log] == 0o750
    assert after["results"] == after["logs"] == after["scratch"] == 0o750


def test_folders_an_earlier_version_made_open_are_closed_at_start(tmp_path: Path) -> None:
    """Storage made by an earlier version keeps its files; its folders are closed to other users
    when the service next starts, which makes every file below them unreachable to them."""
    parts = ("results", "logs", "scratch", "runners")
    for part in parts:
        (tmp_path / part / "old").mkdir(parents=True, mode=0o755)
        os.chmod(tmp_path / part, 0o775)  # group write, as under umask 002: kept
    storage.ResultStore(tmp_path)
    assert {part: oct(stat.S_IMODE((tmp_path / part).stat().st_mode)) for part in parts} == {
        part: oct(0o770) for part in parts
    }


@pytest.fixture
def results_on_another_disk(settings: Settings, tmp_path: Path) -> Path:
    """The storage folder with its `results` folder on "another disk": a link to a folder
    elsewhere, made before the store (and so before any worker or API) first sees the folder.
    Asked for before the fixtures that build the store. Returns the link's target."""
    elsewhere = tmp_path / "big-disk" / "results"
    elsewhere.mkdir(parents=True)
    settings.storage_dir.mkdir(parents=True, exist_ok=True)
    (settings.storage_dir / "results").symlink_to(elsewhere, target_is_directory=True)
    return elsewhere


async def test_results_folder_on_a_linked_disk_stores_a_result_at_the_first_run(
    results_on_another_disk: Path, manager: Any, make_worker: Any, store: storage.ResultStore
) -> None:
    """The start check accepts the linked folder, so a run that succeeded must store its result;
    every new job's first run was handed back (`publish` fsyncs `results/` with O_NOFOLLOW:
    `[Errno 40] Too many levels of symbolic links: '<storage>/results'`) and ran again."""
    store.probe("test")  # the folder takes files: the worker's own check says usable
    job_id = await enqueue(manager, max_attempts=1)
    await make_worker().run()
    job = await manager.get(job_id)
    events = [(e.kind, (e.detail or {}).get("error")) for e in await manager.events(job_id)]
    released = [error for kind, error in events if kind == "released"]
    assert released == [], f"the first run was handed back: {released}"
    assert job.state == JobState.succeeded and job.attempt == 1
    assert (results_on_another_disk / str(job_id) / "1" / "out.txt").read_bytes(), "on the other disk"


async def test_results_folder_on_a_linked_disk_serves_its_downloads(
    results_on_another_disk: Path, settings: Settings, manager: Any, make_worker: Any, make_key: Any
) -> None:
    """A succeeded job's result link answers 200 with the file; it was 404 `file 'out.txt' of job
    ... is not on disk` (`resolve` compared the file's real path with its path through the link)."""
    job_id = await enqueue(manager, max_attempts=1)
    await make_worker().run()
    assert (await manager.get(job_id)).state == JobState.succeeded
    on_disk = results_on_another_disk / str(job_id) / "1" / "out.txt"
    key = await make_key("tester")
    async with api_client(settings, key=key) as http:
        shown = (await http.get(f"/jobs/{job_id}")).json()
        url = next(f["url"] for f in shown["files"] if f["name"] == "out.txt")
        answer = await http.get(url)
        assert answer.status_code == 200, (answer.status_code, answer.text)
        assert answer.content == on_disk.read_bytes()
        # A link below the linked part is still never followed: the attempt's folder moved aside
        # and linked to in its place.
        attempt = on_disk.parent
        attempt.rename(attempt.with_name("moved"))
        attempt.symlink_to(attempt.with_name("moved"))
        assert (await http.get(url)).status_code == 404
