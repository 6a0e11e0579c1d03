"""`gpujobs jobs log [--follow]`: a job's log from the command line, as docs/operations.md says."""

from __future__ import annotations

import asyncio
import re
import uuid

from tests.conftest import api_client
from tests.integration.test_client import gpujobs
from tests.integration.test_stream import submit_toy


async def finished(http, job_id):
    for _ in range(300):
        job = (await http.get(f"/jobs/{job_id}")).json()
        if job["state"] in ("succeeded", "failed", "canceled", "quarantined"):
            return job
        await asyncio.sleep(0.1)
    raise AssertionError(job)


async def test_the_log_of_a_failed_job_is_printed_whole(settings, make_key, store):
    key = await make_key("cli-user")
    async with api_client(settings, run_worker=True, key=key) as http:
        job_id = await submit_toy(http, exit_code=3, steps=3)
        job = await finished(http, job_id)
        code, stdout, stderr = await gpujobs(http, key, "jobs", "log", job_id)
    assert job["state"] == "failed" and code == 0, stderr
    assert stdout == store.log_path(uuid.UUID(job_id), job["attempt"]).read_text()
    assert "PROGRESS 1.000 step 3" in stdout and "toy model stderr line" in stdout


async def test_follow_prints_the_log_as_it_grows_through_a_retry_until_the_job_ends(settings, make_key):
    """Attempt 1 fails and is retried: the follower prints attempt 1's log, says where attempt 2's
    begins, prints it, and ends when the job does, with every line once."""
    key = await make_key("cli-user")
    async with api_client(settings, run_worker=True, key=key) as http:
        job_id = await submit_toy(http, fail_attempts=1, sleep=2.0, steps=8)
        code, stdout, stderr = await gpujobs(http, key, "jobs", "log", "--follow", job_id)
        job = (await http.get(f"/jobs/{job_id}")).json()
    assert code == 0 and (job["state"], job["attempt"]) == ("succeeded", 2), (stderr, job)
    assert stderr.splitlines() == ["--- attempt 2 ---"], stderr
    steps = re.findall(r"^PROGRESS \S+ step (\d+)$", stdout, re.M)
    assert steps == [str(i) for i in range(1, 9)] * 2, stdout  # each attempt's lines, once each
    assert "failing on purpose at attempt 1" in stdout
    assert stdout.count("toy model stderr line") == 2


async def test_a_job_without_a_log_says_why(settings, make_key):
    key = await make_key("cli-user")
    async with api_client(settings, key=key) as http:  # no worker: the job stays queued
        job_id = await submit_toy(http)
        code, stdout, stderr = await gpujobs(http, key, "jobs", "log", job_id)
    assert code == 2 and stdout == "", stdout
    assert stderr.strip() == f"error: job {job_id} has no log yet: it has not run (queued)", stderr
