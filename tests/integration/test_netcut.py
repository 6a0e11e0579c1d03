"""A worker whose link to PostgreSQL is cut while its models run (tests/netcut.py): what it
writes once the link is back."""

from __future__ import annotations

import asyncio
import contextlib
import time

from app import db
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests.conftest import api_client
from tests.fakes import FakeInventory
from tests.integration.test_durability import alive, running, until
from tests.integration.test_worker import enqueue
from tests.netcut import CuttableLink


async def test_a_run_that_ends_while_the_database_is_away_keeps_its_result_and_its_peak(
    manager, make_worker, settings, tmp_path
):
    """README: while PostgreSQL is away, workers keep their models running and retry their final
    writes. A one-shot run whose memory NVML showed wrote its peak first, outside the retried final
    write: the outage failed that write, the attempt took it for an outage before the model ran,
    and the success was never written (the job came back after its lease, as a lost worker's)."""
    assert settings.database_url
    link = CuttableLink(settings.database_url, tmp_path / "link")
    engine = db.create_engine(await link.start(), pool_size=2)
    inventory = FakeInventory([24_576])
    job_id = await enqueue(manager, sleep=2.0, steps=2)
    try:
        async with running(make_worker(burst=False, inventory=inventory, manager_=JobManager(engine))):
            pid = (await until(manager, job_id, lambda j: j.pid is not None)).pid
            inventory.set_process(pid, 1500)
            await asyncio.sleep(0.6)  # read by the attempt's sampler (every 0.5 s)
            link.cut()
            for _ in range(100):  # the model ends about 2 s after its start
                if not alive(pid):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the run's writes after the model meet the cut
            link.mend()
            done = await until(manager, job_id, lambda j: j.state.final)
    finally:
        await engine.dispose()
        await link.close()
    assert (done.state, done.attempt, done.abnormal_runs) == (JobState.succeeded, 1, 0)
    assert done.vram_peak_mb == 1500


async def test_an_idle_worker_claims_soon_after_the_database_is_back(
    manager, make_worker, settings, tmp_path
):
    """An idle worker claims a new job within milliseconds (LISTEN), else within its poll interval
    (0.5 s here). While the database was away, its listener tried to reconnect ever more rarely
    (doubling to 30 s), as did its claims: a job queued once the database was back waited until
    the next of either (here 7 s; up to 30 s after a longer outage). The listener now tries again
    at least every poll interval, and wakes the claims as it reconnects."""
    assert settings.database_url
    link = CuttableLink(settings.database_url, tmp_path / "link")
    url = await link.start()
    engine = db.create_engine(url, pool_size=2)
    try:
        async with running(make_worker(burst=False, manager_=JobManager(engine), listen_url=url)):
            await asyncio.sleep(0.5)  # listening
            link.cut()
            await asyncio.sleep(8)  # the retries spread out: 0.5, 1, 2, 4, 8 s apart
            link.mend()
            started = time.monotonic()
            job_id = await enqueue(manager)  # its NOTIFY finds no listener: the reconnect must wake
            await until(manager, job_id, lambda j: j.state is not JobState.queued)
            waited_s = time.monotonic() - started
    finally:
        await engine.dispose()
        await link.close()
    assert waited_s < 3, waited_s


async def test_event_streams_go_on_soon_after_the_database_is_back(settings, tmp_path):
    """An API process's LISTEN connection (the job feed of every event stream it serves) tried to
    reconnect ever more rarely while the database was away (doubling to 30 s): once it was back,
    open streams showed nothing of their jobs until the next try (here 5.6 s later; up to 30 s
    after a longer outage). It now tries again at least every 2 s."""
    assert settings.database_url
    link = CuttableLink(settings.database_url, tmp_path / "link")
    url = await link.start()
    try:
        async with api_client(settings, database_url=url) as http:
            feed = http.app.state.feed  # type: ignore[attr-defined]
            await asyncio.wait_for(feed.connected.wait(), timeout=10)
            link.cut()
            await asyncio.sleep(7)  # the retries spread out: 0.2, 0.4, 0.8, 1.6, 3.2, 6.4 s apart
            link.mend()
            started = time.monotonic()
            await asyncio.wait_for(feed.connected.wait(), timeout=30)
            waited_s = time.monotonic() - started
    finally:
        await link.close()
    assert waited_s < 3, waited_s


async def test_an_api_whose_database_went_silent_still_stops(settings, tmp_path):
    """An API process asked to stop while its database host had vanished without a reset (a black
    hole: no answer, no error) waited at its end for its pooled connections to say goodbye, which
    never came: the process did not exit, and its supervisor had to kill it."""
    assert settings.database_url
    link = CuttableLink(settings.database_url, tmp_path / "link")
    url = await link.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(api_client(settings, database_url=url))
            assert (await http.get("/jobs")).status_code == 200  # a pooled connection, and the feed's
            link.stall()
            started = time.monotonic()
            async with asyncio.timeout(60):  # a failure, not a test that hangs
                await stack.aclose()
        stopped_s = time.monotonic() - started
    finally:
        await link.close()
    assert stopped_s < 15, stopped_s  # its pooled connections give up after 2 s, its NOTIFYs after 5
