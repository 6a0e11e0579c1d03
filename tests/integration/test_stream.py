"""GET /jobs/{id}/stream: live state and progress over server-sent events, driven by LISTEN/NOTIFY."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
from sqlalchemy import text

from app import db
from tests.conftest import api_client, client_for, png_bytes


async def events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The server-sent events of a streaming response: {id, event, data}."""
    current: dict[str, Any] = {"id": None, "event": "message"}
    data = ""
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield {**current, "data": json.loads(data)}
            current, data = {"id": None, "event": "message"}, ""
        elif line.startswith("id:"):
            current["id"] = int(line[3:].strip())
        elif line.startswith("event:"):
            current["event"] = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


async def submit_toy(http: httpx.AsyncClient, model: str = "toy", **params: Any) -> str:
    """Queue a toy job (or one of `model`) over HTTP; its id."""
    response = await http.post(
        "/jobs",
        files={"image": ("in.png", png_bytes(), "image/png")},
        data={"model": model, "params": json.dumps(params)},
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def states(seen: list[dict[str, Any]]) -> list[str]:
    """The distinct states in order (progress events collapse into one "progress")."""
    out: list[str] = []
    for e in seen:
        label = "progress" if e["event"] == "progress" else e["data"]["state"]
        if not out or out[-1] != label:
            out.append(label)
    return out


async def test_a_real_job_streams_queued_running_progress_succeeded_and_closes(settings, spawn_worker):
    async with api_client(settings) as http:
        job_id = await submit_toy(http, steps=5, sleep=1.5)
        seen: list[dict[str, Any]] = []
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            stream = events(response)
            first = await anext(stream)
            assert first["event"] == "state" and first["data"]["state"] == "queued"
            assert first["data"]["kind"] == "submitted" and first["id"] is not None
            seen.append(first)
            spawn_worker("w")  # a separate process: its NOTIFYs reach this API's one listener
            async with asyncio.timeout(60):
                seen += [e async for e in stream]  # ends when the server closes the stream
        assert states(seen)[:2] == ["queued", "running"]
        assert "progress" in states(seen)
        assert states(seen)[-1] == "succeeded"
        ticks = [e["data"]["progress"] for e in seen if e["event"] == "progress"]
        assert ticks == sorted(ticks) and len(ticks) >= 3
        ids = [e["id"] for e in seen if e["id"] is not None]
        assert ids == sorted(set(ids))  # event ids only grow, never repeat
        history = (await http.get(f"/jobs/{job_id}/events")).json()
        assert ids[-1] == history[-1]["id"]  # the final event carries the last history id


async def test_reconnect_with_last_event_id_resumes_without_duplicates(settings, manager, make_worker):
    async with api_client(settings) as http:
        job_id = await submit_toy(http, steps=4)
        await make_worker().run()
        history = (await http.get(f"/jobs/{job_id}/events")).json()
        assert history[-1]["kind"] == "succeeded"
        resume_after = history[1]["id"]  # as if the client had seen "claimed" and then lost the line
        headers = {"Last-Event-ID": str(resume_after)}
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers=headers) as response:
            replay = [e async for e in events(response)]
        assert [e["id"] for e in replay] == [e["id"] for e in history if e["id"] > resume_after]
        assert [e["data"]["kind"] for e in replay] == [e["kind"] for e in history[2:]]
        assert replay[-1]["data"]["state"] == "succeeded"

        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            fresh = [e async for e in events(response)]
        assert len(fresh) == 1 and fresh[0]["data"]["state"] == "succeeded"  # a finished job: one event
        assert fresh[0]["id"] == history[-1]["id"]


async def test_the_stream_survives_losing_the_listen_connection(settings, make_worker):
    async with api_client(settings) as http:
        job_id = await submit_toy(http, steps=3, sleep=1.5)
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            stream = events(response)
            assert (await anext(stream))["data"]["state"] == "queued"
            feed = http.app.state.feed  # type: ignore[attr-defined]
            await kill_listeners(settings.database_url)  # the API's LISTEN connection dies
            await asyncio.sleep(0.2)
            worker = asyncio.create_task(make_worker().run())
            async with asyncio.timeout(60):
                await feed.connected.wait()  # reconnected: streams re-read what they missed
                rest = [e async for e in stream]
            await worker
        assert rest[-1]["data"]["state"] == "succeeded"
        history = (await http.get(f"/jobs/{job_id}/events")).json()
        ids = [e["id"] for e in rest if e["id"] is not None]
        assert ids == sorted(set(ids)) and ids[-1] == history[-1]["id"]


async def kill_listeners(database_url: str) -> None:
    """Terminate every connection that LISTENs on the job channel."""
    conn = await asyncpg.connect(db.asyncpg_dsn(database_url))
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query LIKE '%gpujobs_job%' AND pid <> pg_backend_pid()"
        )
    finally:
        await conn.close()


async def test_streams_are_private_and_unknown_jobs_are_404(settings, make_key):
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        assert (await http.get("/jobs/00000000-0000-0000-0000-000000000000/stream")).status_code == 404
        async with client_for(http, await make_key("someone-else")) as other:
            assert (await other.get(f"/jobs/{job_id}/stream")).status_code == 404
        async with client_for(http, None) as anonymous:
            assert (await anonymous.get(f"/jobs/{job_id}/stream")).status_code == 401


async def test_event_streams_of_one_key_are_capped(settings, make_key):
    """Nothing capped the event streams one principal held open: each holds a connection, an open
    file and its share of the process's memory for as long as its job runs, so one key could hold
    thousands. Past GPUJOBS_STREAMS_PER_KEY (here 2) a stream is answered 429 with Retry-After;
    another key's streams are served, and a slot frees when a stream closes."""
    async with api_client(settings, streams_per_key=2) as http:
        job_id = await submit_toy(http)  # no worker: it stays queued, and its streams open
        async with contextlib.AsyncExitStack() as held:
            for _ in range(2):
                stream = await held.enter_async_context(http.stream("GET", f"/jobs/{job_id}/stream"))
                assert stream.status_code == 200
            async with http.stream("GET", f"/jobs/{job_id}/stream") as third:
                if third.status_code != 200:  # a stream that opened would never end
                    await third.aread()
            assert third.status_code == 429, third.status_code
            assert int(third.headers["retry-after"]) > 0
            assert "GPUJOBS_STREAMS_PER_KEY" in third.json()["detail"], third.text
            async with client_for(http, await make_key("bob")) as bob:
                bob_job = await submit_toy(bob)
                async with bob.stream("GET", f"/jobs/{bob_job}/stream") as other:
                    assert other.status_code == 200
        for _ in range(30):  # the server sees the held streams go
            async with http.stream("GET", f"/jobs/{job_id}/stream") as again:
                if again.status_code != 429:
                    break
            await asyncio.sleep(0.1)
    assert again.status_code == 200


async def test_the_streams_times_are_written_as_the_history_writes_them(settings, make_worker):
    """The stream wrote an event's `at` as `...+00:00`, while the history (GET /jobs/{id}/events)
    and every other answer write UTC times as `...Z`, as the README promises: a client reading both
    with one strict format broke on the stream."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        await make_worker().run()
        history = (await http.get(f"/jobs/{job_id}/events")).json()
        async with http.stream("GET", f"/jobs/{job_id}/stream", headers={"Last-Event-ID": "0"}) as response:
            replay = [e async for e in events(response)]
    assert [e["data"]["at"] for e in replay] == [e["at"] for e in history]
    assert all(e["at"].endswith("Z") for e in history)


async def test_progress_is_served_as_the_model_reported_it(settings, engine):
    """The job row keeps progress as a 4-byte float (REAL), which reads back into Python as
    0.10000000149011612 for a reported 0.1: GET /jobs/{id} and the stream served that noise, while
    the stream's live notes (written by PostgreSQL) said 0.1. A job's progress is now read as the
    shortest decimal its REAL stands for, as PostgreSQL writes it."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE jobs SET progress = 0.1 WHERE id = :id"), {"id": job_id})
        assert (await http.get(f"/jobs/{job_id}")).json()["progress"] == 0.1
        async with http.stream("GET", f"/jobs/{job_id}/stream") as response:
            first = await anext(events(response))
        assert first["data"]["progress"] == 0.1, first


async def test_a_long_last_event_id_is_ignored_as_the_docs_say(settings):
    """docs/operations.md: a Last-Event-ID that is not a number is ignored, and so is one past the
    job's newest event. One of 41 characters or more (a number past any id, or an id another SSE
    server gave the client) was 422 with FastAPI's list of field errors: an EventSource retrying
    with it got the same 422 every time it came back."""
    async with api_client(settings) as http:
        job_id = await submit_toy(http)
        assert (await http.post(f"/jobs/{job_id}/cancel")).status_code == 200  # one final event
        for value in ("9" * 41, "x" * 64, "9" * 5000, str(2**63)):
            answer = await http.get(f"/jobs/{job_id}/stream", headers={"Last-Event-ID": value})
            assert answer.status_code == 200, answer.text
            assert '"state": "canceled"' in answer.text, answer.text
