"""Metrics, health, logs and the admin views, against real processes and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from app import logs, migrate
from app.queue.jobs import JobState
from tests.conftest import api_client, client_for, free_port, worker_id
from tests.integration.test_durability import running, until
from tests.integration.test_stream import submit_toy
from tests.integration.test_worker import enqueue

MB = 1 << 20


async def scrape(http: httpx.AsyncClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """GET /metrics, parsed with the Prometheus parser: {(sample name, labels): value}."""
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: dict[Any, float], metric: str, /, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((metric, frozenset(labels.items())), 0.0)


async def test_metrics_follow_a_job_through_its_life(settings, make_worker):
    async with api_client(settings, metrics_cache_s=0) as http:
        before = await scrape(http)
        assert value(before, "gpujobs_metrics_database_up") == 1
        job_id = await submit_toy(http, steps=2)
        queued = await scrape(http)
        assert value(queued, "gpujobs_jobs_submitted_total", model="toy") == 1
        assert value(queued, "gpujobs_jobs", state="queued", model="toy") == 1
        assert value(queued, "gpujobs_jobs_finished_total", model="toy", state="succeeded") == 0
        post = {"method": "POST", "route": "/jobs", "status": "201"}
        assert value(queued, "gpujobs_http_request_duration_seconds_count", **post) == 1

        await make_worker().run()
        done = await scrape(http)
        assert (await http.get(f"/jobs/{job_id}")).json()["state"] == "succeeded"
        assert value(done, "gpujobs_jobs", state="queued", model="toy") == 0
        assert value(done, "gpujobs_jobs_finished_total", model="toy", state="succeeded") == 1
        assert value(done, "gpujobs_job_attempts_total", model="toy") == 1
        for name in ("queue_wait", "run", "end_to_end"):
            assert value(done, f"gpujobs_job_{name}_seconds_count", model="toy") == 1
            assert value(done, f"gpujobs_job_{name}_seconds_bucket", model="toy", le="+Inf") == 1
        run_s = value(done, "gpujobs_job_run_seconds_sum", model="toy")
        total_s = value(done, "gpujobs_job_end_to_end_seconds_sum", model="toy")
        assert 0 < run_s <= total_s


async def test_requests_refused_before_routing_are_counted_under_their_route(settings):
    """The security and upload-limit middleware answer before the router runs, so their 401s and
    413s were counted as route="unmatched", though the docs give the series by route template: an
    anonymous flood on one route, or oversized uploads, could not be told from requests to nowhere."""
    async with api_client(settings, max_upload_mb=0.01) as http:
        job_id = await submit_toy(http)
        async with client_for(http, None) as anonymous:
            assert (await anonymous.get(f"/jobs/{job_id}")).status_code == 401
        big = {"image": ("in.png", b"x" * 20_000, "image/png")}
        assert (await http.post("/jobs", files=big, data={"model": "toy"})).status_code == 413
        assert (await http.get("/nowhere")).status_code == 404
        samples = await scrape(http)
    count = "gpujobs_http_request_duration_seconds_count"
    assert value(samples, count, method="GET", route="/jobs/{job_id}", status="401") == 1
    assert value(samples, count, method="POST", route="/jobs", status="413") == 1
    assert value(samples, count, method="GET", route="unmatched", status="404") == 1


async def lose_then_finish(manager, make_worker, lost) -> None:  # type: ignore[no-untyped-def]
    """Claim `lost` (the first job queued) by a worker that vanishes, recover it, then run every
    job to its end with burst workers (until a retry's backoff has passed and it ran again)."""
    [job] = await manager.claim(
        worker_id="test:gone", host="nowhere", models=["toy"], budgets={0: 24_000}, lease_s=0.05
    )
    assert job.job.id == lost
    await asyncio.sleep(0.1)
    assert [t.id for t in await manager.fleet.recover_expired(by_worker="test:reaper")] == [lost]
    for _ in range(50):
        await make_worker().run()
        if all(j.state.final for j in (await manager.listing.page()).jobs):
            break
        await asyncio.sleep(0.05)


async def test_metrics_count_failures_retries_and_recoveries(settings, manager, make_worker):
    async with api_client(settings, metrics_cache_s=0) as http:
        lost = await enqueue(manager)
        await enqueue(manager, fail_attempts=1)  # fails once, then succeeds
        await enqueue(manager, exit_code=65)  # bad input: fails for good
        await lose_then_finish(manager, make_worker, lost)
        samples = await scrape(http)
    assert value(samples, "gpujobs_jobs_submitted_total", model="toy") == 3
    assert value(samples, "gpujobs_jobs_finished_total", model="toy", state="succeeded") == 2
    assert value(samples, "gpujobs_jobs_finished_total", model="toy", state="failed") == 1
    assert value(samples, "gpujobs_job_attempts_total", model="toy") == 5  # 2 + 1 + (lost 1 + 1)
    assert value(samples, "gpujobs_job_recoveries_total", model="toy") == 1
    assert value(samples, "gpujobs_job_run_seconds_count", model="toy") == 5  # every attempt ended
    assert value(samples, "gpujobs_job_queue_wait_seconds_count", model="toy") == 5
    assert value(samples, "gpujobs_job_end_to_end_seconds_count", model="toy") == 3


async def test_two_api_processes_report_the_same_job_numbers(settings, make_worker):
    async with api_client(settings, metrics_cache_s=0) as one, api_client(settings, metrics_cache_s=0) as two:
        for _ in range(3):
            await submit_toy(one)
        await make_worker().run()
        first, second = await scrape(one), await scrape(two)
    jobs = {k: v for k, v in first.items() if k[0].startswith(("gpujobs_job", "gpujobs_jobs"))}
    assert jobs and jobs == {k: second[k] for k in jobs}  # read from the database: they agree
    assert value(first, "gpujobs_jobs_submitted_total", model="toy") == 3
    # ... while HTTP latency is per process: the three POSTs were all served by the first
    post = {"method": "POST", "route": "/jobs", "status": "201"}
    assert value(first, "gpujobs_http_request_duration_seconds_count", **post) == 3
    assert value(second, "gpujobs_http_request_duration_seconds_count", **post) == 0


async def test_worker_and_gpu_gauges_come_from_heartbeats(settings, manager, make_worker):
    job_id = await enqueue(manager, sleep=5, steps=5, vram_mb=3000)
    async with api_client(settings, metrics_cache_s=0) as http, running(make_worker([8192], burst=False)):
        await until(manager, job_id, lambda j: j.state is JobState.running)
        labels = {"worker": worker_id("w1"), "gpu": "0", "name": "fake-0"}
        deadline = time.monotonic() + 10
        while True:  # the next heartbeat (every 0.5 s) records the reservation
            samples = await scrape(http)
            if value(samples, "gpujobs_gpu_memory_reserved_bytes", **labels) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert value(samples, "gpujobs_gpu_memory_reserved_bytes", **labels) == 3000 * MB
        assert value(samples, "gpujobs_gpu_memory_total_bytes", **labels) == 8192 * MB
        assert value(samples, "gpujobs_gpu_memory_free_bytes", **labels) == 8192 * MB  # the fake's NVML
        assert value(samples, "gpujobs_gpu_running_jobs", **labels) == 1
        assert value(samples, "gpujobs_worker_running_jobs", worker=worker_id("w1")) == 1
        assert 0 <= value(samples, "gpujobs_worker_heartbeat_age_seconds", worker=worker_id("w1")) < 3
        assert value(samples, "gpujobs_jobs", state="running", model="toy") == 1

        workers = (await http.get("/admin/workers")).json()
        [w] = workers
        assert w["id"] == worker_id("w1") and w["state"] == "running" and w["live"] is True
        assert w["host"] and w["heartbeat_age_s"] < 3 and w["running_jobs"] == [str(job_id)]
        [g] = w["gpus"]
        assert (g["total_mb"], g["free_mb"], g["reserved_mb"], g["running_jobs"]) == (8192, 8192, 3000, 1)
        await manager.cancel(job_id, owner=None, by="test")


async def test_a_dead_workers_gpus_leave_and_its_heartbeat_age_stays(
    settings, manager, make_worker, spawn_worker
):
    """After a worker's kill -9, its GPUs went on showing the job's reservation and a running job
    (until another worker marked it dead, or for ever without one); then all of its series
    vanished at once, heartbeat age included, some 20 s after its last heartbeat with the default
    settings: the documented `heartbeat_age_seconds > 30` alert could never fire."""
    job_id = await enqueue(manager, sleep=30, steps=30, vram_mb=3000)
    dead = ""

    async def scrape_until(check: Callable[[dict[Any, float]], bool]) -> dict[Any, float]:
        deadline = time.monotonic() + 20
        while not check(samples := await scrape(http)):
            assert time.monotonic() < deadline, {k: v for k, v in samples.items() if dead in str(k)}
            await asyncio.sleep(0.1)
        return samples

    async with api_client(settings, metrics_cache_s=0) as http:
        first = spawn_worker("gone")
        job = await until(manager, job_id, lambda j: j.pid is not None)
        dead = str(job.worker_id)
        gpu = {"worker": dead, "gpu": "0", "name": "virtual-0"}
        await scrape_until(lambda s: value(s, "gpujobs_gpu_memory_reserved_bytes", **gpu) == 3000 * MB)
        first.send_signal(signal.SIGKILL)
        first.wait(5)
        try:
            # Nobody has marked it dead yet, but it stopped heartbeating longer ago than the limit.
            stale = await scrape_until(
                lambda s: value(s, "gpujobs_worker_heartbeat_age_seconds", worker=dead) > 3.5
            )
            assert not [
                k for k in stale if dict(k[1]).get("worker") == dead and k[0].startswith("gpujobs_gpu")
            ]
            # Another worker's reaper takes the job back and marks it dead (the job does not fit
            # its GPU); its age keeps growing where an alert sees it.
            async with running(make_worker([2000], burst=False, name="reaper")):
                await until(manager, job_id, lambda j: j.state is JobState.queued)
                deadline = time.monotonic() + 20
                while True:
                    [state] = [w.state for w in await manager.reports.workers() if w.id == dead]
                    if state == "dead":
                        break
                    assert time.monotonic() < deadline, state
                    await asyncio.sleep(0.1)
                after = await scrape(http)
            assert value(after, "gpujobs_worker_heartbeat_age_seconds", worker=dead) > value(
                stale, "gpujobs_worker_heartbeat_age_seconds", worker=dead
            )
            assert value(after, "gpujobs_worker_running_jobs", worker=dead) == 0
            assert not [
                k for k in after if dict(k[1]).get("worker") == dead and k[0].startswith("gpujobs_gpu")
            ]
            reaper = {"worker": worker_id("reaper"), "gpu": "0", "name": "fake-0"}
            assert value(after, "gpujobs_gpu_memory_total_bytes", **reaper) == 2000 * MB  # live ones stay
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            await manager.cancel(job_id, owner=None, by="test")


async def test_healthz_and_readyz(settings, make_worker):
    async with api_client(settings, key=None) as http, running(make_worker(burst=False)):
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        deadline = time.monotonic() + 10
        while (ready := await http.get("/readyz")).json().get("workers") != 1:
            assert time.monotonic() < deadline, ready.text
            await asyncio.sleep(0.1)
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "ready" and body["schema"]["current"] == migrate.head()
        assert body["gpus"] == [
            {"worker": worker_id("w1"), "index": 0, "name": "fake-0", "total_mb": 24576, "free_mb": 24576,
             "reserved_mb": 0, "running_jobs": 0}
        ]  # fmt: skip
    async with api_client(settings, key=None, ready_min_workers=1) as http:
        await asyncio.sleep(0.1)
        response = await http.get("/readyz")  # the worker stopped: 0 live workers
        assert response.status_code == 503 and "live workers" in response.json()["detail"]
        assert (await http.head("/readyz")).status_code == 503


async def test_probes_answer_head_as_they_answer_get(settings):
    """HEAD, which uptime monitors and load balancers' health checks send, was 405 on the probes
    and on /metrics (RFC 9110: a general-purpose server supports HEAD wherever it answers GET)."""
    async with api_client(settings, key=None) as http:
        for path in ("/healthz", "/readyz", "/metrics"):
            got, head = await http.get(path), await http.head(path)
            assert head.status_code == got.status_code == 200, (path, head.status_code, head.text)
            assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]


async def test_the_pages_a_monitor_checks_answer_head_as_they_answer_get(settings):
    """The service's root, the web page's addresses and /docs answered HEAD 405 (uptime monitors
    check the address a person opens, and often with HEAD)."""
    async with api_client(settings, key=None) as http:
        for path in ("/", "/ui", "/ui/", "/ui/sign-in", "/docs"):
            got, head = await http.get(path), await http.head(path)
            assert head.status_code == got.status_code, (path, head.status_code, head.text)
            assert head.content == b"", path
            for name in ("content-type", "location", "content-security-policy"):
                assert head.headers.get(name) == got.headers.get(name), (path, name)


async def test_readyz_fails_when_the_schema_is_behind(settings):
    async with api_client(settings, key=None) as http:
        assert (await http.get("/readyz")).status_code == 200
        await asyncio.to_thread(migrate.downgrade, settings.database_url, "-1")
        response = await http.get("/readyz")
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        body = response.json()
        assert "gpujobs migrate" in body["detail"] and body["schema"]["current"] != migrate.head()


async def test_readyz_names_a_schema_newer_than_the_code(settings, engine, make_worker):
    """The code was rolled back behind a release that migrated the database: /readyz said to run
    `gpujobs migrate`, which cannot help (this code does not know the newer revision). With
    GPUJOBS_READY_MIN_WORKERS, it also said "0 live workers, 1 needed" beside a live worker: at
    another schema the workers are not read at all."""
    async with running(make_worker(burst=False)), api_client(settings, key=None, ready_min_workers=1) as http:
        deadline = time.monotonic() + 10
        while (ready := await http.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, ready.text
            await asyncio.sleep(0.1)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfacecafe'"))
        response = await http.get("/readyz")
        assert response.status_code == 503
        detail = response.json()["detail"]
        assert "f00dfacecafe" in detail and "does not know" in detail
        assert "run `gpujobs migrate`" not in detail and "live workers" not in detail, detail


async def test_readyz_fails_when_the_database_is_down(settings):
    down = "postgresql+asyncpg://nobody:secret@127.0.0.1:9/nothing"
    async with api_client(settings, key=None, database_url=down) as http:
        assert (await http.get("/healthz")).status_code == 200  # alive, but...
        response = await http.get("/readyz")
        assert response.status_code == 503 and response.json()["status"] == "unavailable"
        assert "database" in response.json()["detail"]
        metrics = await http.get("/metrics")  # still answers, and says the database is away
        assert metrics.status_code == 200 and "gpujobs_metrics_database_up 0.0" in metrics.text


async def test_readyz_tells_an_anonymous_caller_no_database_address(settings):
    """/readyz needs no key, and its 503 gave the database error's text: "database: [Errno 111]
    Connect call failed ('127.0.0.1', 40793)", the database's internal address for anyone to read.
    It says the database is unreachable and the error's class; the whole error goes to the log."""
    port = free_port()
    down = f"postgresql+asyncpg://nobody:secret@127.0.0.1:{port}/nothing"
    handler, stop = capture(logs.JsonFormatter())
    try:
        async with api_client(settings, key=None, database_url=down) as http:
            response = await http.get("/readyz")
    finally:
        stop()
    assert response.status_code == 503
    assert response.json()["detail"] == "database: unreachable (ConnectionRefusedError)", response.text
    [logged] = [e for e in map(json.loads, handler.lines) if e["logger"] == "gpujobs.health"]
    assert str(port) in logged["exception"] and logged["action"] == "db_down", logged


class Lines(logging.Handler):
    """Collect formatted log lines."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(formatter)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def capture(formatter: logging.Formatter) -> tuple[Lines, Callable[[], None]]:
    """Send every log record to a Lines handler until the returned function is called."""
    handler, root = Lines(formatter), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)

    def stop() -> None:
        root.removeHandler(handler)
        root.setLevel(level)

    return handler, stop


async def test_json_logs_carry_request_job_worker_and_attempt_and_no_secrets(settings, make_worker, make_key):
    handler, stop = capture(logs.JsonFormatter())
    key = await make_key("logger", admin=True)
    try:
        async with api_client(settings, key=key) as http:
            job_id = await submit_toy(http)
            await make_worker().run()
            job = (await http.get(f"/jobs/{job_id}", headers={"X-Request-ID": "req-42"})).json()
            answer = await http.get(job["files"][0]["url"])
            assert answer.status_code == 200 and "x-request-id" in answer.headers
    finally:
        stop()
    ours = [line for line in handler.lines if json.loads(line)["logger"].startswith("gpujobs")]
    lines = [json.loads(line) for line in ours]
    [read] = [e for e in lines if e.get("action") == "http_request" and e.get("request_id") == "req-42"]
    assert read["route"] == "/jobs/{job_id}" and read["status"] == 200 and read["job_id"] == job_id
    [submitted] = [e for e in lines if e.get("route") == "/jobs" and e.get("status") == 201]
    assert submitted["job_id"] == job_id and submitted["message"] == "POST /jobs 201"  # the job it made
    [started] = [e for e in lines if e.get("action") == "job_started"]
    assert started["job_id"] == job_id and started["attempt"] == 1 and started["worker"] == worker_id("w1")
    assert any(e.get("action") == "job_succeeded" and e.get("attempt") == 1 for e in lines)
    # At INFO a job that runs once is two worker lines, its start and its outcome: a few lines
    # more per job cost tiny jobs a tenth of a millisecond of the worker's CPU each.
    mine = [e.get("action") for e in lines if e.get("job_id") == job_id]
    worker_lines = [action for action in mine if action != "http_request"]
    assert worker_lines == ["job_started", "job_succeeded"], worker_lines
    text = "\n".join(ours)  # (the test's own HTTP client, httpx, logs its URLs: not ours)
    assert key not in text and "sig=" not in text and "test-secret-of-enough-length" not in text


def test_text_logs_are_readable_and_scrubbed():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.TextFormatter())
    log = logging.getLogger("gpujobs.test")
    log.addHandler(handler)
    log.propagate = False
    try:
        with logs.bound(job_id="j-1", attempt=2):
            log.warning(
                "connecting to postgresql://u:hunter2@db/x with gpj_abcdefghijklmnopqrstuvwxyz",
                extra={"action": "demo", "api_key": "gj_secret", "image": b"\x89PNG" * 10},
            )
    finally:
        log.removeHandler(handler)
    line = stream.getvalue()
    assert "WARNING" in line and "gpujobs.test: connecting to postgresql://u:***@db/x with gpj_***" in line
    assert 'job_id=j-1 attempt=2 action=demo api_key=[redacted] image="<40 bytes>"' in line
    assert "hunter2" not in line and "gj_secret" not in line and "PNG" not in line and "abcdefgh" not in line


async def test_admin_stats(settings, manager, make_worker, store, make_key):
    for _ in range(3):
        await enqueue(manager)
    await enqueue(manager, exit_code=65)
    await make_worker().run()
    await enqueue(manager, priority=7)
    await enqueue(manager, model="toy_timeout", priority=7)
    async with api_client(settings) as http:
        stats = (await http.get("/admin/stats")).json()
        async with client_for(http, await make_key("user")) as user:
            assert (await user.get("/admin/stats")).status_code == 403
            assert (await user.get("/admin/workers")).status_code == 403
    assert sorted((q["state"], q["model"], q["priority"], q["jobs"]) for q in stats["queue"]) == [
        ("queued", "toy", 7, 1),
        ("queued", "toy_timeout", 7, 1),
    ]
    assert (stats["finished"], stats["succeeded"], stats["failed"]) == (4, 3, 1)
    assert stats["failure_rate"] == 0.25
    assert stats["throughput_per_min"] == round(4 / 5, 3)
    assert 0 <= stats["wait_s"]["p50"] <= stats["wait_s"]["p95"]
    assert 0 < stats["run_s"]["p50"] <= stats["run_s"]["p95"]
    results = sum(p.stat().st_size for p in (store.root / "results").rglob("*") if p.is_file())
    assert stats["storage_bytes"]["results"] == results > 0
    assert stats["storage_bytes"]["logs"] > 0 and stats["storage_bytes"]["total"] >= results


async def test_the_storage_folders_free_space_is_shown_before_a_full_disk_bites(settings, store):
    """Only the bytes used were shown (`storage_bytes`): nothing said how close a disk was to full,
    and a full one first showed as failed uploads and paused workers."""
    async with api_client(settings) as http:
        stats = (await http.get("/admin/stats")).json()
        series = await scrape(http)
    for part in ("results", "logs", "scratch"):
        size, _used, free = shutil.disk_usage(store.root / part)
        shown = stats["storage_free_bytes"][part]
        assert abs(shown - free) < 64 * 2**20, (part, shown, free)  # the disk's others write meanwhile
        labels = frozenset({("part", part)})
        assert series[("gpujobs_storage_size_bytes", labels)] == size
        assert abs(series[("gpujobs_storage_free_bytes", labels)] - free) < 64 * 2**20


async def test_a_worker_that_does_not_share_the_apis_storage_folder_is_shown_so(
    settings, store, make_worker, tmp_path
):
    """Results and logs are served from the API's storage folder: a worker writing to another one
    (a host without the shared mount) made jobs whose downloads answered 404, and logs empty, with
    nothing anywhere saying why."""
    from app import storage

    apart = storage.ResultStore(tmp_path / "another-host")
    async with (
        running(make_worker(burst=False, name="shares")),
        running(make_worker(burst=False, name="apart", store_=apart)),
        api_client(settings) as http,
    ):
        # Once both registered (a worker takes its lanes' lock before): asked at once, one could be
        # missing yet (a rerun in a fresh-clone run).
        deadline = time.monotonic() + 10
        while (
            len(shown := {w["id"]: w["shares_storage"] for w in (await http.get("/admin/workers")).json()})
            < 2
        ):
            assert time.monotonic() < deadline, shown
            await asyncio.sleep(0.05)
    assert shown == {worker_id("shares"): True, worker_id("apart"): False}
    async with api_client(settings) as http:  # stopped: a lock file is held only while a worker runs
        assert {w["shares_storage"] for w in (await http.get("/admin/workers")).json()} == {None}


async def test_admin_actions_refuse_fields_they_do_not_know(settings, manager, make_worker, engine):
    """A misspelt field is not a missing one: `{"dry-run": true}` pruned for real, and a retry filter
    with a typo (`modle`) queued every failed job of every model again."""
    from tests.integration.test_retention import age

    failed = await enqueue(manager, exit_code=65)
    await make_worker().run()
    await age(engine, failed)  # finished ten days ago
    async with api_client(settings) as http:
        for path, body, field in (
            ("/admin/prune", {"older_than_s": 86_400, "dry-run": True}, "dry-run"),
            ("/admin/jobs/retry", {"modle": "toy_timeout"}, "modle"),
        ):
            answer = await http.post(path, json=body)
            assert answer.status_code == 422, (path, answer.text)
            assert [e["loc"] for e in answer.json()["detail"]] == [["body", field]], answer.text
        job = (await http.get(f"/jobs/{failed}")).json()
        assert job["state"] == "failed" and job["expired_at"] is None  # neither retried nor pruned
        dry = await http.post("/admin/prune", json={"older_than_s": 86_400, "dry_run": True})
        assert dry.json()["jobs"] == 1  # the fields it knows still work


async def test_metrics_answer_in_time_while_the_database_does_not(settings):
    """A database host that takes connections and never answers (a partition, a hung server) held
    every scrape for asyncpg's 60 s connect timeout, past any scrape timeout: Prometheus then lost
    every series, `gpujobs_metrics_database_up` included, instead of reading that one as 0."""
    held: list[asyncio.StreamWriter] = []
    hang = asyncio.Event()  # until set, connections are dropped at once (a quick start-up)

    async def database(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        if not hang.is_set():
            writer.close()

    server = await asyncio.start_server(database, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    hung = f"postgresql+asyncpg://nobody:secret@127.0.0.1:{port}/nothing"
    try:
        async with api_client(settings, key=None, database_url=hung) as http:
            hang.set()
            for _ in range(2):  # and the next scrape does not wait on the database again
                started = time.monotonic()
                answer = await http.get("/metrics", timeout=30)
                assert answer.status_code == 200 and time.monotonic() - started < 10
                assert "gpujobs_metrics_database_up 0.0" in answer.text
            hang.clear()  # the connections still trying fail now: the app's shutdown waits on none
            for writer in held:
                writer.close()
    finally:
        server.close()


async def test_the_api_starts_and_answers_healthz_while_the_database_does_not(settings):
    """At start the API asks the database whether an admin key exists, to tell the operator how
    to make one. A database host that takes connections and never answers held the start-up for
    asyncpg's 60 s connect timeout, and /healthz, a liveness probe, went unanswered all along."""
    held: list[asyncio.StreamWriter] = []

    async def database(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # never answers

    server = await asyncio.start_server(database, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    hung = f"postgresql+asyncpg://nobody:secret@127.0.0.1:{port}/nothing"
    try:
        started = time.monotonic()
        async with api_client(settings, key=None, database_url=hung) as http:
            assert time.monotonic() - started < 15
            assert (await http.get("/healthz")).status_code == 200
            ready = await http.get("/readyz", timeout=30)  # says why, not only "TimeoutError"
            assert ready.status_code == 503 and "no answer within 5 s" in ready.json()["detail"], ready.text
            for writer in held:  # the connections still trying fail now: shutdown waits on none
                writer.close()
    finally:
        server.close()


async def test_the_queue_gauge_says_zero_rather_than_nothing(settings, make_worker):
    """`gpujobs_jobs` had no series for a model with no unfinished job, and lost its series when
    the queue emptied: `sum(gpujobs_jobs{state="queued"})` then read as no data, not 0, and an
    alert on an empty queue of a model could not be written."""
    async with api_client(settings, metrics_cache_s=0) as http:
        models = {m["name"] for m in (await http.get("/models")).json()["models"]}
        empty = await scrape(http)
        for state in ("queued", "scheduled", "running"):
            for model in models:
                assert empty[("gpujobs_jobs", frozenset({"state": state, "model": model}.items()))] == 0
        await submit_toy(http)
        assert value(await scrape(http), "gpujobs_jobs", state="queued", model="toy") == 1
        await make_worker().run()
        done = await scrape(http)
    assert done[("gpujobs_jobs", frozenset({"state": "queued", "model": "toy"}.items()))] == 0


async def test_an_out_of_memory_run_queued_again_is_a_line_of_the_log(manager, make_worker):
    """Each of a job's state changes is a log line (docs/operations.md, "Logs"), but a run out of
    GPU memory went back to the queue without one: two `job_started` in a row, and nothing of why."""
    handler, stop = capture(logs.JsonFormatter())
    try:
        job_id = await enqueue(manager, vram_mb=4000, oom_attempts=1, max_attempts=1)
        async with running(make_worker(burst=False)):
            job = await until(manager, job_id, lambda j: j.state.final)
    finally:
        stop()
    mine = [
        e for e in map(json.loads, handler.lines) if e.get("job_id") == str(job_id) and e["level"] != "DEBUG"
    ]
    assert [e["action"] for e in mine] == ["job_started", "job_queued", "job_started", "job_succeeded"]
    assert mine[1]["vram_mb"] == job.vram_mb > 4000
