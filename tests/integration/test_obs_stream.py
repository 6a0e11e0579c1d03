"""GET /jobs/{id}/stream: what a reconnecting client is told once its job has ended, and the order
of what it is told."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text

from app import db
from app.queue import sql
from app.queue.jobs import JobState
from tests.conftest import api_client, client_for, lock_waiter, script_model, signed_in, toy_model
from tests.integration.test_batching import CLAIM
from tests.integration.test_stream import events, kill_listeners, submit_toy
from tests.integration.test_worker import enqueue


async def test_a_reconnect_after_the_final_event_is_told_to_stop(settings, make_worker):
    """The stream closes after the final event, and a browser's EventSource (which the docs say to
    use) then reconnects by itself with Last-Event-ID, 2 s later: it got an empty stream, closed
    again, and so on for ever, a request and a database read every 2 s for a job long finished.
    204 is what tells an EventSource to stop."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        await make_worker().run()
        history = (await http.get(f"/jobs/{job_id}/events")).json()
        final = history[-1]["id"]
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            [last] = [e async for e in events(response)]
        assert last["id"] == final and last["data"]["state"] == "succeeded"

        again = await http.get(f"/jobs/{job_id}/stream", headers={"Last-Event-ID": str(final)})
        assert again.status_code == 204 and again.content == b"", again.text

        missed = {"Last-Event-ID": str(history[-2]["id"])}  # one it had not seen: it gets it
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers=missed) as response:
            assert response.status_code == 200
            assert [e["id"] async for e in events(response)] == [final]


STAGES = """\
import pathlib, sys, time
for fraction, stage in ((0.9, "meshing"), (0.2, "texturing"), (0.6, "texturing")):
    print("PROGRESS", fraction, stage, flush=True)
    time.sleep(0.6)
pathlib.Path(sys.argv[1], "out.txt").write_text("done")
"""


EARLY = """\
import pathlib, sys, time
print("PROGRESS 0.25", flush=True)
print("PROGRESS 0.5", flush=True)
time.sleep(1.5)
pathlib.Path(sys.argv[1], "out.txt").write_text("done")
"""


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`; `stages`, a model whose progress starts again for its second stage; `early`, one
    that reports half its progress as it starts, before its run's `started` event is written."""
    path = tmp_path / "models.toml"
    path.write_text(
        toy_model("toy")
        + script_model("stages", ["{python}", "-c", STAGES, "{output_dir}"])
        + script_model("early", ["{python}", "-c", EARLY, "{output_dir}"])
    )
    return path


async def test_a_replayed_history_never_takes_progress_back(settings, make_worker):
    """The `started` event is written half a second into a run, after the progress milestones of a
    model that reports at once: replayed (a reconnect), it came with progress 0.0 after 0.25 and
    0.5, and the client's bar went back. An event that is not progress now carries the progress
    of its attempt so far."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http, model="early")
        await make_worker().run()
        history = (await http.get(f"/jobs/{job_id}/events")).json()
        kinds = [e["kind"] for e in history]
        assert kinds.index("progress") < kinds.index("started"), kinds  # the order this is about
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers={"Last-Event-ID": "0"}) as response:
            replay = [e["data"] async for e in events(response)]
    assert [e["kind"] for e in replay] == kinds
    progress = [e["progress"] for e in replay]
    assert progress == sorted(progress) and progress[-1] == 1.0, replay


async def test_progress_that_starts_again_for_a_new_stage_reaches_the_stream(settings, manager, make_worker):
    """A model reporting each stage from 0 to 1 (nothing in docs/models.md says a fraction only
    grows): GET /jobs/{id} said "texturing" at 20 %, while the stream dropped every report below
    the highest it had sent, so the page and `submit --wait` showed "meshing" at 90 % to the end."""
    job_id = await enqueue(manager, model="stages")
    async with api_client(settings) as http:
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            worker = asyncio.create_task(make_worker().run())
            seen = [e async for e in events(response)]
            await worker
    shown = [(e["data"]["progress"], e["data"].get("message")) for e in seen if e["event"] == "progress"]
    live = [p for p in shown if p[1] is not None]
    assert live == [(0.9, "meshing"), (0.2, "texturing"), (0.6, "texturing")], shown
    assert seen[-1]["data"]["state"] == "succeeded"


async def test_a_progress_milestone_and_a_cancel_at_once_are_told_in_the_order_of_their_ids(
    manager, engine, settings
):
    """A milestone's event was written without the job row's lock, so a cancel could take the next
    id and commit first: a stream that had seen the cancel then skipped the milestone as old, and a
    reconnect with Last-Event-ID never replayed it. Here the milestone is slowed between taking its
    id and writing its row (a trigger); the cancel must wait for it, so notes come in id order."""
    job_id = await enqueue(manager)
    [claimed] = await manager.claim(**CLAIM, budgets={0: 10_000}, limit=1)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION slow_milestone() RETURNS trigger LANGUAGE plpgsql AS $$ "
                "BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER slow_milestone BEFORE INSERT ON job_events FOR EACH ROW "
                "WHEN (NEW.kind = 'progress') EXECUTE FUNCTION slow_milestone()"
            )
        )
    heard: list[dict[str, Any]] = []
    listener = await asyncpg.connect(db.asyncpg_dsn(settings.database_url))
    try:
        await listener.add_listener(sql.JOB_CHANNEL, lambda *args: heard.append(json.loads(args[3])))
        milestone = asyncio.create_task(manager.add_event(claimed.job, "progress", {"progress": 0.25}))
        for _ in range(200):  # until the milestone has its id and sleeps in its trigger
            if await listener.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'"):
                break
            await asyncio.sleep(0.01)
        assert (await manager.cancel(job_id, owner=None, by="tester"))[0] is JobState.running
        await milestone
        for _ in range(50):  # notes come after their commits
            if len(heard) >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await listener.close()
    told = [(note["kind"], note["event"]) for note in heard]
    assert [kind for kind, _ in told] == ["progress", "cancel_requested"], told
    assert told[0][1] < told[1][1], told


async def test_a_resync_after_a_reconnect_sends_nothing_the_client_had_seen(settings):
    """A client that reconnected with Last-Event-ID n, with nothing newer, left the stream's newest
    sent id at 0; when the API's LISTEN connection then dropped, the stream re-read the history
    after 0 and sent the job's every event again, though nothing is to be sent twice."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        newest = (await http.get(f"/jobs/{job_id}/events")).json()[-1]["id"]
        feed = http.app.state.feed  # type: ignore[attr-defined]
        seen: list[dict[str, Any]] = []

        async def read() -> None:
            headers = {"Last-Event-ID": str(newest)}
            async with http.stream("GET", f"/jobs/{job_id}/stream", headers=headers) as response:
                async for event in events(response):
                    seen.append(event)

        reader = asyncio.create_task(read())
        for _ in range(200):  # until the stream has caught up and listens
            if feed.subscribers:
                break
            await asyncio.sleep(0.05)
        await kill_listeners(settings.database_url)  # the feed reconnects and resyncs every stream
        for _ in range(200):
            if not feed.connected.is_set():
                break
            await asyncio.sleep(0.05)
        async with asyncio.timeout(30):
            await feed.connected.wait()
        await asyncio.sleep(0.5)  # time for the stream to re-read the history
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        assert seen == []


@pytest.mark.parametrize("value", [b"\xb2", b"1\xb3\xb9"])  # '²', '1³¹' in latin-1
async def test_a_last_event_id_of_other_than_ascii_digits_is_ignored(settings, value):
    """Header bytes are read as latin-1, so b'\\xb2' became '²', which str.isdigit() accepts and
    int() refuses: the stream answered 500. A Last-Event-ID that is not a number is ignored, as the
    docs say: the stream starts as on a first connect."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        newest = (await http.get(f"/jobs/{job_id}/events")).json()[-1]["id"]
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers={"Last-Event-ID": value}) as response:
            assert response.status_code == 200
            first = await anext(events(response))
        assert first["id"] == newest and first["data"]["state"] == "queued"


HISTORY_READ = "%FROM job_events AS e JOIN jobs AS j%"  # sql.EVENTS, as pg_stat_activity shows it


@contextlib.asynccontextmanager
async def history_held(manager, engine) -> AsyncIterator[tuple[uuid.UUID, Callable[[], Awaitable[None]]]]:
    """A running job whose history (job_events) is locked. `end()` waits until a reader waits on
    that lock (it has read the job by then), then commits the job's success and lets it go on."""
    job_id = await enqueue(manager)
    [claimed] = await manager.claim(**CLAIM, budgets={0: 10_000}, limit=1)
    success = {"ids": [job_id], "attempts": [claimed.job.attempt], "results": ["[]"], "details": ["{}"]}
    async with engine.connect() as conn:
        await conn.execute(text("LOCK TABLE job_events IN ACCESS EXCLUSIVE MODE"))

        async def end() -> None:
            await lock_waiter(engine, HISTORY_READ)
            await conn.execute(sql.SUCCEED, success)
            await conn.commit()

        yield job_id, end


async def test_a_stream_opened_as_its_job_ends_tells_the_end_and_closes(manager, engine, settings):
    """A stream read the job, then its history, in two statements: a job that ended in between
    was read running, with its final event the newest of the history. The stream sent that event
    with the state `running`, took the job for one still going, and then dropped the live note of
    the end as one already sent: it never closed, and `submit --wait` waited for ever. Here the
    history's read waits (a lock) while the job's success is committed."""
    seen: list[dict[str, Any]] = []
    async with api_client(settings) as http, history_held(manager, engine) as (job_id, end):
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            await end()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    async for event in events(response):  # ends when the server closes the stream
                        seen.append(event)
    assert seen and seen[-1]["data"]["state"] == "succeeded", seen
    assert seen[-1]["data"]["kind"] == "succeeded", seen


async def test_a_job_page_read_as_its_job_ends_shows_one_moment(manager, engine, settings, make_key):
    """The job page read the job, then its history, in two statements: a job that ended in between
    showed `running` (with its cancel button) above a history ending in `succeeded`. Here the
    history's read waits (a lock) while the job's success is committed."""
    async with api_client(settings) as api, client_for(api, None) as browser:
        await signed_in(browser, await make_key("admin", admin=True))
        async with history_held(manager, engine) as (job_id, end):
            page = asyncio.create_task(browser.get(f"/ui/jobs/{job_id}/live"))
            await end()
            html = (await page).text
    state = re.search(r'data-state="([a-z_]+)"', html)
    kinds = re.findall(r'class="event e-([a-z_]+)"', html)
    assert state and kinds, html
    assert (state.group(1) == "succeeded") == ("succeeded" in kinds), (state.group(1), kinds)


async def test_a_stream_whose_reread_meets_a_database_error_ends_its_body_cleanly(settings, engine, caplog):
    """After the job feed reconnected, a stream re-read the history (RESYNC); a database error then
    (the server restarting, its connection cut) escaped the body: the response was cut mid-chunk,
    with an ERROR "Exception in ASGI application" in the log. It ends its body as it does when the
    server exits, so the client reconnects with Last-Event-ID, and logs a warning."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        feed = http.app.state.feed  # type: ignore[attr-defined]
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            stream = events(response)
            assert (await anext(stream))["data"]["state"] == "queued"
            async with engine.connect() as conn:
                await conn.execute(text("LOCK TABLE job_events IN ACCESS EXCLUSIVE MODE"))
                await kill_listeners(settings.database_url)  # the feed reconnects: RESYNC
                reader = await lock_waiter(engine, HISTORY_READ, timeout_s=15)  # the stream's re-read
                async with engine.connect() as probe:  # its connection goes, as in a restart
                    await probe.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": reader})
                await conn.rollback()
            async with asyncio.timeout(10):
                rest = [e async for e in stream]  # the body ends: no RemoteProtocolError
        assert rest == []
        assert feed.subscribers == 0
    warned = [r for r in caplog.records if getattr(r, "action", None) == "stream_db_error"]
    assert [r.levelname for r in warned] == ["WARNING"], caplog.records


async def test_a_last_event_id_beyond_the_jobs_events_still_gets_the_end(settings, make_worker):
    """A Last-Event-ID past the job's newest event (ids come from one sequence for every job: a
    client or a proxy may replay another job's) was taken as seen: every later event of the job,
    the final one included, was dropped as already sent, and the stream sent keepalives for ever.
    An id the job never had is now ignored, as one that is not a number: the stream starts afresh,
    sends the final state and ends, for a running job and for a finished one."""
    beyond = {"Last-Event-ID": str(10**12)}
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        feed = http.app.state.feed  # type: ignore[attr-defined]
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers=beyond) as response:
            stream = events(response)
            first = await asyncio.wait_for(anext(stream), 10)
            assert first["data"]["state"] == "queued", first  # the current state, as on a first connect
            assert feed.subscribers
            await make_worker().run()
            async with asyncio.timeout(20):
                rest = [e async for e in stream]  # ends when the server closes the stream
        assert rest and rest[-1]["data"]["state"] == "succeeded", rest
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers=beyond) as response:
            assert response.status_code == 200  # not 204: it never saw the end
            [again] = [e async for e in events(response)]
        assert again["data"]["state"] == "succeeded"
