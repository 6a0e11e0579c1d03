"""Clients that stop reading their answer, or read it slowly: real `gpujobs serve` processes, raw
sockets with a small receive buffer (so that the answer waits on the server), and the server's
open files and memory read in /proc."""

from __future__ import annotations

import io
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from app import storage
from tests.conftest import bearer
from tests.integration.test_serve_processes import serving, until
from tests.integration.test_worker import enqueue

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads the server in /proc")

TIMEOUT_S = 2  # GPUJOBS_CLIENT_TIMEOUT_S of the servers below
# More than the kernel's buffers of a connection hold (its send buffer grows to 4 MB at most by
# default), so that the server waits on the client for most of the answer.
BIG_LOG_BYTES = 16 * 1024 * 1024
RECEIVE_BUFFER_BYTES = 4096


@pytest.fixture
async def big_log(settings, manager, make_worker) -> tuple[uuid.UUID, Path]:  # type: ignore[no-untyped-def]
    """A finished job whose log is BIG_LOG_BYTES long: (its id, the log's path)."""
    job_id = await enqueue(manager)
    await make_worker().run()
    path = storage.log_file(settings.storage_dir.resolve(), job_id, 1)
    with path.open("ab") as f:
        f.write(os.urandom(BIG_LOG_BYTES))
    return job_id, path


@pytest.fixture
async def admin_key(make_key: Callable[..., Any]) -> str:
    """An admin's API key."""
    key: str = await make_key("admin", admin=True)
    return key


def link(base: str, key: str, job_id: uuid.UUID, name: str) -> str:
    """The path (and query) of one of a job's links, as the server signed it."""
    answer = httpx.get(f"{base}/jobs/{job_id}", headers=bearer(key), timeout=10)
    url = httpx.URL(answer.json()["links"][name])
    return url.raw_path.decode()


def send_get(base: str, path: str, key: str | None = None) -> socket.socket:
    """A new connection, with a small receive buffer, that has sent `GET path`."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    url = httpx.URL(base)
    sock.connect((url.host, url.port or 80))
    auth = "".join(f"{k}: {v}\r\n" for k, v in bearer(key).items())
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n{auth}\r\n".encode())
    return sock


def read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """The answer's status line and headers, and the start of its body read with them."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(RECEIVE_BUFFER_BYTES)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def header(head: bytes, name: str) -> str:
    """The value of header `name` in an answer's head."""
    lines = head.decode("latin-1").split("\r\n")[1:]
    return next(v.strip() for k, _, v in (line.partition(":") for line in lines) if k.lower() == name)


def read_rest(sock: socket.socket, *, timeout_s: float) -> tuple[int, bool]:
    """Read what the server still sends: (bytes read, whether it ended the connection)."""
    sock.settimeout(timeout_s)
    count = 0
    try:
        while chunk := sock.recv(1024 * 1024):
            count += len(chunk)
    except ConnectionResetError:  # aborted: the unsent rest dropped
        return count, True
    except TimeoutError:
        return count, False
    return count, True


def files_open(pid: int, path: Path) -> int:
    """How many descriptors of process `pid` are open on `path` (deleted since, too)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        count += target in (str(path), f"{path} (deleted)")
    return count


def dropped(tmp_path: Path) -> int:
    """How many connections the server dropped as their clients stopped reading, as its log says."""
    return (tmp_path / "serve.log").read_text().count("action=client_not_reading")


def rss_kb(pid: int) -> int:
    """The resident memory of process `pid`, in KB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def test_a_download_nobody_reads_is_dropped_and_its_file_closed(settings, tmp_path, big_log, admin_key):
    """Three clients ask for a large log and never read the answer, and the log is deleted. The
    server waited for ever to write it: each kept its connection, the task sending the answer and
    the open file, whose disk space a deletion did not free. Now each connection is dropped about
    GPUJOBS_CLIENT_TIMEOUT_S after its client stopped taking bytes, and the file is closed."""
    job_id, path = big_log
    with serving(settings, tmp_path, "--no-worker", client_timeout_s=str(TIMEOUT_S)) as (serve, base):
        url = link(base, admin_key, job_id, "log")
        clients = [send_get(base, url) for _ in range(3)]
        until(lambda: files_open(serve.pid, path) == 3, timeout_s=10, what="the downloads started")
        started = time.monotonic()
        path.unlink()  # as retention deletes a job's files: its space comes back once none has it open
        until(lambda: files_open(serve.pid, path) == 0, timeout_s=TIMEOUT_S + 8, what="the log closed")
        assert time.monotonic() - started > TIMEOUT_S / 2  # not cut at once
        for client in clients:
            received, ended = read_rest(client, timeout_s=5)
            assert ended and received < BIG_LOG_BYTES
            client.close()
        assert dropped(tmp_path) == 3


def test_a_slow_reader_gets_the_whole_download(settings, tmp_path, big_log, admin_key):
    """A client that pauses for most of GPUJOBS_CLIENT_TIMEOUT_S between reads, for several times
    that in all, gets the whole log: the clock restarts each time it takes more."""
    job_id, path = big_log
    with serving(settings, tmp_path, "--no-worker", client_timeout_s=str(TIMEOUT_S)) as (_, base):
        client = send_get(base, link(base, admin_key, job_id, "log"))
        head, body = read_head(client)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(header(head, "content-length"))
        started, received = time.monotonic(), len(body)
        while received < length:
            time.sleep(TIMEOUT_S * 0.6)  # the server waits on this client all along
            wanted = min(3 * 1024 * 1024, length - received)
            received += (got := read_some(client, wanted))
            assert got == wanted, f"the answer ended after {received} of {length} bytes"
        client.close()
    assert received == length == path.stat().st_size
    assert time.monotonic() - started > 2 * TIMEOUT_S


def read_some(sock: socket.socket, size: int) -> int:
    """Read `size` bytes as they come; how many were read, fewer if the connection ended."""
    sock.settimeout(10)
    count = 0
    try:
        while count < size and (chunk := sock.recv(min(size - count, 256 * 1024))):
            count += len(chunk)
    except ConnectionResetError:
        pass
    return count


def noise_png(megabytes: int) -> bytes:
    """A PNG of random pixels, about `megabytes` MB (it does not compress)."""
    side = int((megabytes * 1024 * 1024 / 3) ** 0.5)
    image = Image.frombytes("RGB", (side, side), os.urandom(side * side * 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


IMAGE_MB = 16
STALLED_READERS = 12


@pytest.fixture
async def big_input(manager) -> tuple[uuid.UUID, bytes]:  # type: ignore[no-untyped-def]
    """A job whose uploaded image is IMAGE_MB large: (its id, the image)."""
    image = noise_png(IMAGE_MB)
    return await enqueue(manager, image=image), image


def test_stalled_readers_of_an_input_do_not_each_hold_the_image(settings, tmp_path, big_input, admin_key):
    """Twelve clients ask for a 16 MB uploaded image and stop reading. Each answer was written whole,
    and the unsent rest of each (most of the image) stayed in the server's memory for as long as the
    client kept its connection: for ever. Now the image is sent a piece at a time and held once
    while it is, and each connection is dropped after GPUJOBS_CLIENT_TIMEOUT_S. A client that reads
    gets the image byte for byte, with the headers it had."""
    job_id, image = big_input
    path = f"/jobs/{job_id}/input"
    with serving(settings, tmp_path, "--no-worker", client_timeout_s=str(2 * TIMEOUT_S)) as (serve, base):
        answer = httpx.get(base + path, headers=bearer(admin_key), timeout=10)
        assert answer.status_code == 200 and answer.content == image
        assert answer.headers["content-type"] == "image/png"
        assert answer.headers["content-length"] == str(len(image))
        assert answer.headers["cache-control"] == "private, max-age=86400"
        assert "transfer-encoding" not in answer.headers
        before_kb = rss_kb(serve.pid)
        clients = []
        for _ in range(STALLED_READERS):  # each answer started before the next request
            clients.append(send_get(base, path, admin_key))
            assert read_head(clients[-1])[0].startswith(b"HTTP/1.1 200")
        time.sleep(0.5)  # the server writes what the connections take
        grown_mb = (rss_kb(serve.pid) - before_kb) / 1024
        assert grown_mb < STALLED_READERS * IMAGE_MB / 3, grown_mb
        # A client sees the end only once it reads again: the server's log says when it came.
        until(lambda: dropped(tmp_path) == STALLED_READERS, timeout_s=2 * TIMEOUT_S + 6, what="drops")
        for client in clients:
            received, ended = read_rest(client, timeout_s=2)
            assert ended and received < len(image)
            client.close()


def test_a_download_in_flight_at_a_stop_ends_quietly(settings, tmp_path, big_log, admin_key):
    """SIGTERM while a client is still being sent a large log: uvicorn waited out its grace (5 s),
    then cancelled the answer's task and logged an error and a traceback. Now the answer is broken
    off just before, as for a client gone, and the log says so in one line, not as an error."""
    job_id, path = big_log
    with serving(settings, tmp_path, "--no-worker") as (serve, base):
        client = send_get(base, link(base, admin_key, job_id, "log"))
        until(lambda: files_open(serve.pid, path) == 1, timeout_s=10, what="the download started")
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=15) == 128 + signal.SIGTERM
        client.close()
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert "answer_cut" in log
