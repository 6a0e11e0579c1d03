"""`gpujobs check`: every kept result read back against its job's row, as docs/operations.md says."""

from __future__ import annotations

import json
import uuid

from sqlalchemy import text

from app import check
from app.queue.jobs import JobState
from tests.conftest import worker_env
from tests.integration.test_client import run_cli
from tests.integration.test_worker import enqueue


async def succeeded(manager, make_worker, count):
    """`count` toy jobs run to success; their ids."""
    ids = [await enqueue(manager) for _ in range(count)]
    await make_worker().run()
    for job_id in ids:
        assert (await manager.get(job_id)).state is JobState.succeeded
    return ids


def result(store, job_id):
    return store.root / "results" / str(job_id) / "1" / "out.txt"


async def test_a_store_as_stored_passes_and_each_kind_of_damage_is_named(
    settings, manager, make_worker, store
):
    ok, gone, cut, edited, linked = await succeeded(manager, make_worker, 5)
    await enqueue(manager, exit_code=3, max_attempts=1)  # a failed job: no results to check
    await make_worker().run()
    env = worker_env(settings, "check")
    code, stdout, stderr = await run_cli(env, "check", "--hash")
    assert code == 0, stderr
    assert stdout.strip().splitlines()[-1].startswith("checked 5 succeeded jobs, 5 files, "), stdout

    stray = store.root / "results" / str(uuid.uuid4()) / "1"
    stray.mkdir(parents=True)
    (stray / "out.txt").write_bytes(b"12345")
    code, stdout, _ = await run_cli(env, "check")
    unknown = f"unknown: results/{stray.parent.name} (5 bytes): the database has no such job (left as it is)"
    assert code == 0 and stdout.splitlines()[0] == unknown, stdout  # not damage: said, exit 0

    result(store, gone).unlink()
    result(store, cut).write_text("do")
    size = result(store, edited).stat().st_size
    result(store, edited).write_text("X" * size)  # the same size: only its digest tells
    target = result(store, linked)
    target.rename(target.with_name("elsewhere.txt"))
    target.symlink_to(target.with_name("elsewhere.txt"))

    code, stdout, _ = await run_cli(env, "check")
    lines = stdout.strip().splitlines()
    assert code == 1, stdout
    assert f"missing: job {gone}, out.txt (results/{gone}/1/out.txt): not on disk" in lines
    assert any(line.startswith(f"size: job {cut}, out.txt") and "2 bytes on disk" in line for line in lines)
    assert any(line.startswith(f"not a file: job {linked}, out.txt") for line in lines)
    assert unknown in lines
    assert not any(str(edited) in line for line in lines[:-1]), "sizes only, without --hash"
    assert not any(str(ok) in line for line in lines)
    assert lines[-1].endswith(": 3 not as stored, 1 folders of unknown jobs"), lines

    code, stdout, _ = await run_cli(env, "check", "--hash", "--json")
    report = json.loads(stdout)
    assert code == 1 and report["clean"] is False and report["hashed"] is True
    problems = {f["job_id"]: f["problem"] for f in report["findings"]}
    assert problems == {
        str(gone): "missing",
        str(cut): "size",
        str(edited): "changed",
        str(linked): "not a file",
    }
    assert (report["jobs"], report["files"]) == (5, 5)
    assert stray.exists() and result(store, gone).parent.exists(), "the check changes nothing"


async def test_a_job_expired_while_the_check_runs_is_not_reported_missing(
    settings, manager, make_worker, store, engine
):
    """Retention marks a job expired, then deletes its files: between the check's read of a page
    and its look at the disk, a file may go with its job. That is retention, not damage."""
    [job_id] = await succeeded(manager, make_worker, 1)
    real = check.kept_results

    async def retention_in_between(engine_):
        async for rows in real(engine_):
            async with engine.begin() as conn:
                await conn.execute(text("UPDATE jobs SET expired_at = now() WHERE id = :id"), {"id": job_id})
            result(store, job_id).unlink()
            yield rows

    check.kept_results = retention_in_between
    try:
        report = await check.run(engine, check.results_root(settings.storage_dir))
    finally:
        check.kept_results = real
    assert report.jobs == 1 and report.findings == [], report
    code, stdout, _ = await run_cli(worker_env(settings, "check"), "check")
    assert code == 0 and stdout.startswith("checked 0 succeeded jobs"), stdout


async def test_a_storage_folder_without_results_is_refused_before_anything_is_made(settings, tmp_path):
    """A wrong GPUJOBS_STORAGE_DIR would check nothing and say all is well (and with the embedded
    database, make a new empty one there); it is refused, naming the setting."""
    wrong = tmp_path / "not-the-storage"
    env = {**worker_env(settings, "check"), "GPUJOBS_STORAGE_DIR": str(wrong)}
    code, stdout, stderr = await run_cli(env, "check")
    assert code == 2 and stdout == "", stdout
    assert stderr.startswith(f"error: GPUJOBS_STORAGE_DIR: {wrong / 'results'} is not a folder"), stderr
    assert not wrong.exists()
    env.pop("GPUJOBS_DATABASE_URL")  # the embedded database's folder would be made below it
    code, _, stderr = await run_cli(env, "check")
    assert code == 2 and "is not a folder" in stderr and not wrong.exists(), stderr


async def test_many_jobs_are_read_a_page_at_a_time(
    settings, manager, make_worker, store, engine, monkeypatch
):
    """Jobs are read in pages by id: none is checked twice or left out across a page's edge."""
    monkeypatch.setattr(check, "PAGE", 2)
    ids = await succeeded(manager, make_worker, 5)
    for job_id in ids[1::2]:
        result(store, job_id).unlink()
    report = await check.run(engine, check.results_root(settings.storage_dir))
    assert (report.jobs, report.files) == (5, 5)
    assert sorted(f.job_id for f in report.findings) == sorted(str(i) for i in ids[1::2])
    assert {f.problem for f in report.findings} == {"missing"}
