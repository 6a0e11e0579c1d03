"""An upload into a full queue (or a principal's full share) is refused before its body is read.

The queue limits are checked exactly by the enqueue, once the upload has arrived whole; the API
process remembers what such a refusal said and, while it does, counts again before the body. A
client that asks first (`Expect: 100-continue`) then sends nothing of an upload it would be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from sqlalchemy import event

from app.api import limits
from tests import rawhttp
from tests.conftest import api_client, client_for
from tests.integration.test_api_intake import counts, submit

# A client that declares 15 MB of upload (within the 20 MB limit) and waits to be told to send it.
ASKING = {"Content-Type": "multipart/form-data; boundary=b", "Content-Length": str(15 << 20)}
# What the count made before the body says, and only it (app/queue/sql.py, ROOM).
ROOM_MARK = "AS owner_waiting"


async def asked_first(http: httpx.AsyncClient, key: str | None = None) -> tuple[bytes, float, float]:
    """POST /jobs's head with `Expect: 100-continue` over a raw socket, then wait without sending a
    byte of the body, as curl does; given a whole final answer, send nothing more (EOF), as curl
    does. Returns (every byte the server sent until it closed the connection or invited the body
    with 100 Continue, seconds to the first of them, to the last)."""
    key = key or http.headers["authorization"].removeprefix("Bearer ")
    reader, writer = await asyncio.open_connection(http.base_url.host, http.base_url.port)
    head = [
        "POST /jobs HTTP/1.1",
        f"Host: {http.base_url.host}",
        f"Authorization: Bearer {key}",
        "Expect: 100-continue",
        *(f"{k}: {v}" for k, v in ASKING.items()),
    ]
    started = time.monotonic()
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())

    def enough(received: bytes) -> bool:
        if received.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in received:
            return True  # told to send the body: a client would now
        if answered(received) and writer.can_write_eof():
            writer.write_eof()  # then the server closes: at once, not after its drain
        return False

    try:
        received, first_s = await rawhttp.collect(reader, started, enough=enough)
        return received, first_s, time.monotonic() - started
    finally:
        writer.close()


def answered(received: bytes) -> bool:
    """Whether `received` holds a whole answer (its head, and a body of its Content-Length)."""
    head, found, body = received.partition(b"\r\n\r\n")
    length = [
        line.partition(b":")[2] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    ]
    return bool(found and length and len(body) >= int(length[0]))


def refused_at_once(received: bytes, first_s: float, closed_s: float) -> tuple[dict[str, str], bytes]:
    """Check the answer of `asked_first` is a whole 429, sent before any body and without inviting
    it, on a connection the server then closed cleanly; (its headers, its body)."""
    assert received.startswith(b"HTTP/1.1 429 "), received[:300]
    head, _, body = received.partition(b"\r\n\r\n")
    assert b" 100 " not in head and b"continue" not in head.lower(), head
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, _, value in (line.decode().partition(":") for line in head.split(b"\r\n")[1:])
    )
    assert len(body) == int(headers["content-length"]), (headers, body)  # all of it, then the close
    assert headers["connection"] == "close" and int(headers["retry-after"]) > 0, headers
    assert first_s < 1.0, f"answered after {first_s:.2f} s"
    assert closed_s < limits.DRAIN_S, f"closed after {closed_s:.2f} s"
    return headers, body


@contextlib.asynccontextmanager
async def statements_of(http: httpx.AsyncClient) -> AsyncIterator[list[str]]:
    """Every statement the app behind `http` sends on its engine meanwhile (asyncpg's query logger
    on each pooled connection it checks out: the upload's statements bypass SQLAlchemy's events)."""
    sent: list[str] = []
    engine = http.app.state.engine  # type: ignore[attr-defined]
    logged: set[int] = set()

    def on_checkout(dbapi_connection: Any, *_: Any) -> None:
        driver = dbapi_connection.driver_connection
        if id(driver) not in logged:
            logged.add(id(driver))
            driver.add_query_logger(lambda query: sent.append(query.query))

    event.listen(engine.sync_engine, "checkout", on_checkout)
    try:
        yield sent
    finally:
        event.remove(engine.sync_engine, "checkout", on_checkout)


async def cancel(http: httpx.AsyncClient, job: httpx.Response) -> None:
    answer = await http.post(f"/jobs/{job.json()['id']}/cancel")
    assert answer.status_code == 200, answer.text


async def test_a_full_queue_refuses_an_upload_that_asks_first_without_its_body(settings, png, engine):
    """Before, the 429 came only once the whole body had been sent, parsed and checked: a client
    that sent `Expect: 100-continue` was told to send its 15 MB (100 Continue), then waited."""
    async with api_client(settings, queue_limit=2) as http:
        for i in range(2):
            assert (await submit(http, png(color=(i, 1, 1)))).status_code == 201
        late = await submit(http, png(color=(7, 7, 7)))  # the enqueue finds the queue full
        assert late.status_code == 429 and "queue is full" in late.json()["detail"], late.text
        for _ in range(2):  # the connection is closed cleanly: the next client is answered the same
            headers, body = refused_at_once(*await asked_first(http))
            assert json.loads(body) == late.json() and headers["retry-after"] == late.headers["retry-after"]
    assert await counts(engine) == (2, 2, 2)  # nothing of the refused uploads was written


async def test_a_full_share_refuses_its_principal_only_without_the_body(settings, make_key, png, engine):
    alice, second_alice, bob = await make_key("alice"), await make_key("alice"), await make_key("bob")
    async with api_client(settings, key=alice, queue_limit_per_key=1) as http:
        assert (await submit(http, png(color=(1, 1, 1)))).status_code == 201
        late = await submit(http, png(color=(2, 2, 2)))
        assert late.status_code == 429 and "1 jobs waiting" in late.json()["detail"], late.text
        for key in (alice, second_alice):  # the principal's keys share it
            _, body = refused_at_once(*await asked_first(http, key))
            assert json.loads(body) == late.json()
        async with client_for(http, bob) as other:  # another principal's uploads go on
            assert (await submit(other, png(color=(3, 3, 3)))).status_code == 201
            received, _, _ = await asked_first(other)
            assert received.startswith(b"HTTP/1.1 100 Continue"), received[:200]
    assert await counts(engine) == (2, 2, 2)


async def test_an_upload_is_taken_as_soon_as_the_queue_has_room(settings, make_key, png, engine):
    """No refusal from a memory of a full queue that has drained since."""
    async with api_client(settings, queue_limit=2) as http:
        jobs = [await submit(http, png(color=(i, 2, 2))) for i in range(2)]
        assert (await submit(http, png(color=(9, 9, 9)))).status_code == 429
        refused_at_once(*await asked_first(http))
        await cancel(http, jobs[0])
        assert (await submit(http, png(color=(5, 5, 5)))).status_code == 201
        assert (await submit(http, png(color=(6, 6, 6)))).status_code == 429
    alice = await make_key("alice")
    async with api_client(settings, key=alice, queue_limit_per_key=1) as http:
        mine = await submit(http, png(color=(1, 2, 3)))
        assert (await submit(http, png(color=(2, 3, 4)))).status_code == 429
        refused_at_once(*await asked_first(http))
        await cancel(http, mine)
        received, _, _ = await asked_first(http)  # invited to send its body at once
        assert received.startswith(b"HTTP/1.1 100 Continue"), received[:200]
        assert (await submit(http, png(color=(3, 4, 5)))).status_code == 201
    assert (await counts(engine))[0] == 5


async def test_a_repeat_of_an_idempotent_upload_still_gets_its_job_while_full(settings, png):
    """The enqueue answers a repeat with its job before it looks at the limits: so does the count."""
    async with api_client(settings, queue_limit=1) as http:
        first = await submit(http, png(color=(1, 1, 1)), headers={"Idempotency-Key": "k1"})
        assert first.status_code == 201
        assert (await submit(http, png(color=(2, 2, 2)))).status_code == 429
        again = await submit(http, png(color=(1, 1, 1)), headers={"Idempotency-Key": "k1"})
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
        other = await submit(http, png(color=(3, 3, 3)), headers={"Idempotency-Key": "k2"})
        assert other.status_code == 429 and "queue is full" in other.json()["detail"]


async def test_the_count_before_the_body_runs_only_while_a_full_queue_is_remembered(settings, png):
    """The normal path sends no statement more than before: the count runs only after the enqueue
    said the queue was full, and stops once it found room."""
    async with api_client(settings, queue_limit=3) as http:
        async with statements_of(http) as sent:
            jobs = [await submit(http, png(color=(i, 3, 3))) for i in range(3)]
            assert [j.status_code for j in jobs] == [201] * 3
            assert any("INSERT INTO jobs" in s for s in sent), sent  # the logger sees the uploads
            assert not [s for s in sent if ROOM_MARK in s]
            assert (await submit(http, png(color=(9, 9, 9)))).status_code == 429  # the late check
            assert not [s for s in sent if ROOM_MARK in s]
            refused_at_once(*await asked_first(http))
            assert len([s for s in sent if ROOM_MARK in s]) == 1
            await cancel(http, jobs[0])
            sent.clear()
            assert (await submit(http, png(color=(4, 4, 4)))).status_code == 201  # counted: room
            assert len([s for s in sent if ROOM_MARK in s]) == 1
            sent.clear()
            await cancel(http, jobs[1])
            assert (await submit(http, png(color=(5, 5, 5)))).status_code == 201  # forgotten: no count
            assert not [s for s in sent if ROOM_MARK in s], sent


def test_principals_remembered_full_are_bounded() -> None:
    """A principal's full share is remembered in a bounded table: the oldest is forgotten first
    (its next upload is checked late, as before)."""
    from app.api import fullness

    memory = fullness.Fullness(queue_limit=10, owner_limit=1, most_owners=2)
    for principal in ("a", "b", "c"):
        memory.saw_full(principal, waiting=0)
    assert [memory.remembers(p) for p in ("a", "b", "c")] == [False, True, True]
    memory.saw_full("b", waiting=10)  # the queue too
    assert memory.remembers("a") and memory.remembers("zed")
    without_share = fullness.Fullness(queue_limit=10, owner_limit=0)
    without_share.saw_full("a", waiting=3)
    assert not without_share.remembers("a")
