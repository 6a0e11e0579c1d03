"""/metrics of API processes that share PROMETHEUS_MULTIPROC_DIR, as `gpujobs serve --processes N`
runs them behind one port: whichever process a scrape reaches reports the whole service."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app import metrics
from app.api.main import create_app
from tests.conftest import api_client, create_key, free_port, http_client, wait_until_serving, worker_env
from tests.integration.test_observability import scrape, value
from tests.integration.test_stream import submit_toy

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # the client's variable: it picks its mode on import
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
GET_JOB = {"method": "GET", "route": "/jobs/{job_id}", "status": "200"}


@contextlib.contextmanager
def serving_processes(settings: Any, folder: Path, logs: Path, count: int) -> Iterator[list[Any]]:
    """`count` `gpujobs serve --no-worker` processes, each on its own port, all on this test's
    database and sharing the multiprocess folder; yields [(base URL, process)]."""
    env = worker_env(settings, "serve", log_level="WARNING")
    env[MULTIPROC_DIR] = str(folder)
    started = []
    for i in range(count):
        port, log = free_port(), logs / f"serve-{i}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "app", "serve", "--no-worker", "--port", str(port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append((f"http://127.0.0.1:{port}", process, log))
    try:
        for base, process, log in started:
            wait_until_serving(process, base, log)
        yield [(base, process) for base, process, _ in started]
    finally:
        for _, process, _ in started:
            if process.poll() is None:
                process.terminate()
            process.wait(timeout=30)


async def exposition(http: httpx.AsyncClient) -> tuple[Samples, list[str]]:
    """GET /metrics: the samples, and every family name as often as it appears."""
    response = await http.get("/metrics")
    assert response.status_code == 200, response.text
    families = list(text_string_to_metric_families(response.text))
    keys = [(s.name, frozenset(s.labels.items())) for f in families for s in f.samples]
    assert len(keys) == len(set(keys)), "a sample appears twice"
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}, [
        f.name for f in families
    ]


async def opened(stream: httpx.Response) -> AsyncIterator[str]:
    """Wait for the stream's first line (by then the server counts it); the rest of its lines.

    Keep what it returns: an iterator of the lines that is dropped closes the stream."""
    assert stream.status_code == 200
    lines = stream.aiter_lines()
    assert await anext(lines) == "retry: 2000"
    return lines


async def subscribers_become(http: httpx.AsyncClient, expected: float, timeout_s: float = 10) -> None:
    """Poll /metrics until gpujobs_stream_subscribers is `expected` (a closed stream ends a moment later)."""
    deadline = time.monotonic() + timeout_s
    while (seen := value(await scrape(http), "gpujobs_stream_subscribers")) != expected:
        assert time.monotonic() < deadline, f"gpujobs_stream_subscribers is {seen}, not {expected}"
        await asyncio.sleep(0.05)


async def test_processes_sharing_the_folder_each_report_the_whole_service(settings, tmp_path, monkeypatch):
    """Each process reported its own requests and streams only: behind one port, a scrape reaching
    one process said 3 requests where the service had served 5, and jumped with each scrape."""
    folder = tmp_path / "prometheus"
    folder.mkdir()
    key = await create_key(settings.database_url, "admin", admin=True)
    with serving_processes(settings, folder, tmp_path, 2) as [(base_a, _), (base_b, b)]:
        async with http_client(base_a, key) as one, http_client(base_b, key) as two:
            job_id = await submit_toy(one)
            for http, times in ((one, 3), (two, 2)):
                for _ in range(times):
                    assert (await http.get(f"/jobs/{job_id}")).status_code == 200
            url = f"/jobs/{job_id}/stream"
            async with one.stream("GET", url) as first:
                _first_lines = await opened(first)
                async with two.stream("GET", url) as second:
                    _second_lines = await opened(second)
                    for http in (one, two):
                        samples, names = await exposition(http)
                        assert value(samples, "gpujobs_http_request_duration_seconds_count", **GET_JOB) == 5
                        assert value(samples, "gpujobs_stream_subscribers") == 2
                        # the database series once (not summed over the processes), as before
                        assert value(samples, "gpujobs_jobs_submitted_total", model="toy") == 1
                        assert names.count("gpujobs_jobs_submitted") == 1
                        # one process's numbers, wrong when summed: left out
                        assert not [n for n in names if n.startswith(("process_", "python_gc_"))], names
                        assert "python_info" in names
                    b.kill()  # SIGKILL: no chance to tidy up; the serve parent reports its end
                    b.wait(timeout=10)
                dead = await scrape(one)
                assert value(dead, "gpujobs_stream_subscribers") == 2  # not told yet
                monkeypatch.setenv(MULTIPROC_DIR, str(folder))  # as the serve parent has it
                metrics.mark_process_dead(b.pid)
                told = await scrape(one)
                assert value(told, "gpujobs_stream_subscribers") == 1  # the living process's stream
                # the dead process's requests stay counted: a counter that fell would read as a reset
                assert value(told, "gpujobs_http_request_duration_seconds_count", **GET_JOB) == 5
            await subscribers_become(one, 0)


async def test_without_the_folder_each_process_reports_its_own_and_nothing_is_marked_dead(settings):
    """No PROMETHEUS_MULTIPROC_DIR: the per-process series as they were (this process's streams,
    process_* and python_* series), and mark_process_dead, which the serve parent calls whatever
    the mode, does nothing."""
    assert MULTIPROC_DIR not in os.environ
    async with api_client(settings) as one, api_client(settings) as two:
        job_id = await submit_toy(one)
        async with one.stream("GET", f"/jobs/{job_id}/stream") as stream:
            _lines = await opened(stream)
            own, other = await scrape(one), await scrape(two)
            assert value(own, "gpujobs_stream_subscribers") == 1
            assert value(other, "gpujobs_stream_subscribers") == 0
            metrics.mark_process_dead(os.getpid())
            assert value(await scrape(one), "gpujobs_stream_subscribers") == 1
        await subscribers_become(one, 0)
        _, names = await exposition(one)
    assert {"process_cpu_seconds", "python_gc_objects_collected", "python_info"} <= set(names), names


async def test_a_folder_set_after_the_client_was_imported_is_refused(settings, tmp_path, monkeypatch):
    """The client picks its mode when it is imported: a folder set later would be silently
    ignored, each process reporting only its own numbers while the operator believes otherwise."""
    monkeypatch.setenv(MULTIPROC_DIR, str(tmp_path))
    app = create_app(settings)
    with pytest.raises(RuntimeError, match="set after prometheus_client was imported"):
        async with app.router.lifespan_context(app):
            pass
