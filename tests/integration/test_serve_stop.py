"""`gpujobs serve` on SIGTERM: it stops claiming at once, open event streams end cleanly at once,
and a new connection is refused at once, in one process or in several.

Real `gpujobs serve` processes (tests/integration/test_serve_processes.py's `serving`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy

from tests.integration.test_clients import MODEL_PART, PART, _upload_head, noisy_png
from tests.integration.test_durability import kinds, until
from tests.integration.test_serve_processes import serving
from tests.integration.test_serve_processes import until as wait_for
from tests.integration.test_worker import enqueue
from tests.integration.test_worker_stop import handed_back, left_no_model, marked, two_running
from tests.netcut import CuttableLink

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")

# Most of the GPU (GPUJOBS_GPUS=24GiB in worker_env): one such job runs at a time.
BIG_MB = 20000


async def first_event(http: httpx.AsyncClient, job_id: object) -> tuple[httpx.Response, AsyncIterator[str]]:
    """An event stream of the job, open, its first event (the current state) read; its lines."""
    request = http.build_request("GET", f"/jobs/{job_id}/stream")
    response = await http.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    while not (await anext(lines)).startswith("data:"):
        pass
    return response, lines


async def test_sigterm_stops_claiming_at_once_though_a_stream_is_open(settings, manager, make_key, tmp_path):
    """A job queued at SIGTERM was claimed, and run, for up to 5 s after it: the worker was told to
    stop only once uvicorn had waited that long for open connections (here: an event stream)."""
    auth = {"Authorization": f"Bearer {await make_key('ops', admin=True)}"}
    with serving(settings, tmp_path, shutdown_grace_s=10) as (serve, base):
        # Long enough to outlast the stream's opening on a loaded machine: ended before the
        # SIGTERM, it let `waiting` be claimed as it should (0.8 s was overrun under load).
        running = await enqueue(manager, sleep=3.0, steps=2, vram_mb=BIG_MB)
        await until(manager, running, lambda j: j.pid is not None)
        waiting = await enqueue(manager, vram_mb=BIG_MB)  # waits for the GPU `running` holds
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
            stream, _ = await first_event(http, waiting)
            serve.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(serve.wait, 30) == 143
            await stream.aclose()
    assert (await manager.get(running)).state.value == "succeeded"  # within the grace
    assert "claimed" not in await kinds(manager, waiting)
    assert (await manager.get(waiting)).state.value == "queued"


async def test_sigterm_ends_open_streams_cleanly_at_once(settings, manager, make_key, tmp_path):
    """An open event stream held every shutdown for 5 s, then was cut (the client's "peer closed
    connection without sending complete message body"; an ERROR traceback in the log). It ends its
    body at once instead; the client reconnects with Last-Event-ID."""
    auth = {"Authorization": f"Bearer {await make_key('ops', admin=True)}"}
    job_id = await enqueue(manager)
    with serving(settings, tmp_path, "--no-worker") as (serve, base):
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
            _, lines = await first_event(http, job_id)
            signalled = time.monotonic()
            serve.send_signal(signal.SIGTERM)
            async for _ in lines:  # RemoteProtocolError if cut
                pass
            ended_s = time.monotonic() - signalled
            assert await asyncio.to_thread(serve.wait, 30) == 143
            stopped_s = time.monotonic() - signalled
    assert ended_s < 1.5, ended_s
    assert stopped_s < 3, stopped_s
    log = (tmp_path / "serve.log").read_text()
    assert "Exception in ASGI application" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


async def test_a_connection_after_sigterm_is_refused_with_several_processes(settings, manager, tmp_path):
    """The parent kept its copy of the listening socket until every child had exited, so while one
    still stopped (its worker's jobs in their grace) the kernel accepted connections nobody would
    serve: they hung, then were reset. They are refused, as with one process."""
    with serving(settings, tmp_path, "--processes", "2", shutdown_grace_s=3) as (serve, base):
        job_id = await enqueue(manager, sleep=30, steps=30, vram_mb=BIG_MB)
        await until(manager, job_id, lambda j: j.pid is not None)
        port = int(base.rsplit(":", 1)[1])
        serve.send_signal(signal.SIGTERM)
        log = tmp_path / "serve.log"
        await asyncio.to_thread(
            wait_for, lambda: "SIGTERM: stopping the API processes" in log.read_text(), what="SIGTERM"
        )
        await asyncio.sleep(1)  # the children have closed theirs; the worker's job is in its grace
        assert serve.poll() is None
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert await asyncio.to_thread(serve.wait, 30) == 0


@contextlib.asynccontextmanager
async def serving_beside(  # type: ignore[no-untyped-def]
    settings, tmp_path: Path, *args: str, **env: str
) -> AsyncIterator[subprocess.Popen[bytes]]:
    """`serving`, entered and left in a thread: this loop runs the link to the database meanwhile."""
    within = serving(settings, tmp_path, *args, **env)
    serve, _ = await asyncio.to_thread(within.__enter__)
    try:
        yield serve
    finally:
        await asyncio.to_thread(within.__exit__, None, None, None)


@pytest.mark.parametrize(
    ("processes", "cut", "first", "again"),
    [
        ("1", True, signal.SIGTERM, signal.SIGINT),
        ("1", False, signal.SIGTERM, signal.SIGTERM),
        ("1", False, signal.SIGINT, signal.SIGINT),
        ("2", False, signal.SIGTERM, signal.SIGTERM),
    ],
    ids=["database away, Ctrl-C", "in the grace", "Ctrl-C twice", "several processes"],
)
async def test_a_second_signal_stops_serve_at_once(settings, manager, tmp_path, processes, cut, first, again):
    """As `gpujobs worker` (test_worker_stop.py): asked again while it stops, `serve` kills its
    worker's models and warm runner, hands its jobs back (with the database away, leaves them to
    their leases) and exits. Before, a second
    SIGTERM did nothing and a second Ctrl-C did not reach the worker, which waited out its grace,
    then for the database, forever; with several processes, the parent killed the children, whose
    models and warm runner lived on."""
    assert settings.database_url
    link = CuttableLink(settings.database_url, tmp_path / "link")
    url = await link.start()
    env = {"shutdown_grace_s": "1" if cut else "60", "database_url": url}
    try:
        async with serving_beside(settings, tmp_path, "--processes", processes, **env) as serve:
            jobs = await two_running(manager)
            if cut:
                link.cut()
            serve.send_signal(first)
            await asyncio.sleep(3 if cut else 1.5)  # the grace passed, or goes on
            assert serve.poll() is None
            assert cut or len(marked("serve")) == 2
            serve.send_signal(again)
            started = time.monotonic()
            code = await asyncio.to_thread(serve.wait, 30)
            stopped_s = time.monotonic() - started
    finally:
        await link.close()
    log = tmp_path / "serve.log"
    assert stopped_s < 8, (stopped_s, log.read_text()[-3000:])
    # Exit code 1, as `gpujobs worker` stopped at once: one process exited 143 as after a graceful
    # stop (SIGTERM), and a supervisor could not tell them apart.
    assert code == 1, (code, log.read_text()[-3000:])
    left_no_model("serve", log, jobs)
    if not cut:  # handed back, no attempt spent
        await handed_back(manager, jobs)
    for job_id in jobs if cut else ():  # left to the worker's restart or their leases
        assert (await manager.get(job_id)).state.value == "running"


async def test_a_second_signal_while_a_request_is_in_flight_still_hands_the_jobs_back(
    settings, manager, make_key, tmp_path
):
    """uvicorn waits up to 5 s for requests in flight before it ends the app's lifespan, and a second
    signal in that wait ends the wait and skipped the lifespan's end: the worker, told to stop at
    once, was cancelled with the loop before it handed its jobs back, which stayed running under
    its name until their leases ran out (an attempt spent), and the upload was cancelled with a
    traceback in the log. Open connections are now closed (the upload reads a disconnect), and the
    lifespan ends all the same."""
    key = await make_key("uploader")
    with serving(settings, tmp_path, shutdown_grace_s=60) as (serve, base):
        jobs = await two_running(manager)
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as upload:  # its body half sent
            head = (
                f"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n"
            )
            upload.sendall(head.encode() + b"--b\r\n")
            await asyncio.sleep(0.5)  # the request is in flight: uvicorn waits for it
            serve.send_signal(signal.SIGTERM)
            await asyncio.sleep(1.5)  # uvicorn's wait for the upload goes on
            assert serve.poll() is None
            serve.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(serve.wait, 30)
    log = tmp_path / "serve.log"
    assert code == 1, (code, log.read_text()[-3000:])
    text = log.read_text()
    assert "Application shutdown complete" in text, text[-3000:]  # the lifespan's end ran
    assert "Traceback" not in text, text[-3000:]  # the upload ended as a disconnect, not cancelled
    left_no_model("serve", log, jobs)
    await handed_back(manager, jobs)


# A PNG of about 1 MB, sent whole in one form.
BODY = MODEL_PART + PART + noisy_png(600) + b"\r\n--b--\r\n"


async def answer_of(reader: asyncio.StreamReader, *, wait_s: float = 20) -> bytes:
    """All the server sends until it closes the connection (b"" for a reset or nothing)."""
    received = b""
    try:
        async with asyncio.timeout(wait_s):
            while piece := await reader.read(1 << 16):
                received += piece
    except ConnectionError:
        pass
    return received


async def jobs_in(engine) -> int:  # type: ignore[no-untyped-def]
    async with engine.connect() as conn:
        return int(await conn.scalar(sqlalchemy.text("SELECT count(*) FROM jobs")))


async def test_an_upload_still_arriving_at_the_end_of_a_stop_is_answered_503(
    settings, engine, make_key, tmp_path
):
    """An upload still arriving when the graceful stop's 5 s ran out had its connection reset, no
    answer at all (and the log said `POST /jobs 400`): the client could not tell the server going
    away from a broken network. It is answered 503 with Retry-After, and no job exists."""
    key = await make_key("alice")
    with serving(settings, tmp_path, "--no-worker") as (serve, base):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(_upload_head(key, len(BODY)))

        async def slowly() -> None:  # about 100 KB/s: 10 s for the whole body
            step = len(BODY) // 100
            for start in range(0, len(BODY), step):
                writer.write(BODY[start : start + step])
                await writer.drain()
                await asyncio.sleep(0.1)

        sending = asyncio.create_task(slowly())
        await asyncio.sleep(2)
        serve.send_signal(signal.SIGTERM)
        answer = await answer_of(reader)
        sending.cancel()
        writer.close()
        assert await asyncio.to_thread(serve.wait, 30) == 143
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
    assert b"retry-after: " in answer.lower() and b"connection: close" in answer.lower(), answer
    assert await jobs_in(engine) == 0
    log = (tmp_path / "serve.log").read_text()
    assert "action=body_cut" in log and "Traceback" not in log, log[-3000:]


async def test_an_upload_whose_job_is_written_during_a_stop_gets_its_answer(
    settings, engine, make_key, tmp_path
):
    """An upload sent whole, whose job was being written when the stop's grace neared its end (a
    busy database), had its connection reset half a second before the grace ran out, though its
    job was written a moment later: one job queued, and its client told nothing, so that a retry
    (without an Idempotency-Key) queued a second. Its answer, 201, now comes."""
    key = await make_key("alice")
    with serving(settings, tmp_path, "--no-worker") as (serve, base):
        async with engine.connect() as busy:
            holding = await busy.begin()
            await busy.execute(sqlalchemy.text("LOCK TABLE jobs IN SHARE MODE"))  # an insert waits
            reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
            writer.write(_upload_head(key, len(BODY)) + BODY)
            await writer.drain()
            await asyncio.sleep(1)
            serve.send_signal(signal.SIGTERM)
            await asyncio.sleep(4.7)  # uvicorn's grace is 5 s; answers were cut at 4.5 s
            await holding.commit()
        answer = await answer_of(reader)
        writer.close()
        assert await asyncio.to_thread(serve.wait, 30) == 143
    assert await jobs_in(engine) == 1
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
