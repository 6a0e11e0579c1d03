"""The embedded server, killed (kill -9, the OOM killer), is started again by the process holding it.

Before, `serve` answered 503 on /readyz and every database route until it was restarted itself,
and a worker lost every job meanwhile. Real `gpujobs serve` and `gpujobs worker` processes share
one storage folder here, as they do on a single GPU box; the in-process tests drive
`pgserver.EmbeddedPostgres.watch` with a short interval.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from app import db, pgserver
from app.queue import sql
from tests.conftest import free_port, png_bytes, toy_model, wait_until_serving, worker_name
from tests.integration.test_durability import alive
from tests.integration.test_pgserver_stale import _postmaster, _stop_server, _wait_gone

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads processes from /proc")

# Ports these tests prefer (others on the host use the ephemeral range): the first free one.
PORTS = range(18500, 18600)
# How soon a killed server must answer again: the watch's interval, its start, the pools' reconnect.
BACK_WITHIN_S = 30


def _port() -> int:
    """A free port of PORTS, else any free one."""
    for port in PORTS:
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    return free_port()


def _socket_dir(data: Path) -> str:
    """The socket folder the folder's server listens in (line 5 of postmaster.pid)."""
    return (data / "postmaster.pid").read_text().splitlines()[4].strip()


def _listening(data: Path, timeout_s: float) -> None:
    """Wait until a worker's listener has subscribed (its last LISTEN done) on the folder's server."""
    dsn = f"postgresql://postgres@/postgres?host={_socket_dir(data)}"
    query = f"SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %{sql.CANCEL_CHANNEL}%'"

    async def subscribed() -> bool:
        conn = await asyncpg.connect(dsn)
        try:
            return bool(await conn.fetchval(query))
        finally:
            await conn.close()

    def ask() -> bool:
        # asyncio.run in a thread of its own: run in the main thread, it attaches the child watcher
        # to its loop and detaches it at its end, and this process's later tests (on the session's
        # loop) could spawn no subprocess ("get_child_watcher() is not activated").
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, subscribed()).result()

    deadline = time.monotonic() + timeout_s
    while not ask():
        assert time.monotonic() < deadline, f"the worker did not LISTEN within {timeout_s} s"
        time.sleep(0.1)


def _kill(postmaster: int) -> None:
    """kill -9 the server, as the OOM killer does, and wait until it is gone (its children, which
    notice within moments, are left to themselves)."""
    os.kill(postmaster, signal.SIGKILL)
    _wait_gone([postmaster])


def _new_postmaster(data: Path, old: int, timeout_s: float) -> int:
    """The folder's live server once it is another process than `old`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = _postmaster(data)
            if pid != old and alive(pid):
                return pid
        assert time.monotonic() < deadline, f"no server was started again within {timeout_s} s"
        time.sleep(0.05)


@contextlib.contextmanager
def _processes(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Started processes by name (logs in tmp_path/<name>.log); killed at the end, and the folder's
    server, if one is left, stopped (a failed run leaves no server behind)."""
    started: dict[str, subprocess.Popen[bytes]] = {}
    try:
        yield started
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        with contextlib.suppress(OSError, ValueError, IndexError):
            _stop_server(_postmaster(tmp_path / "storage" / "pgdata"))


def _env(tmp_path: Path, name: str) -> dict[str, str]:
    """The environment of a command `name` on the test's storage folder (its embedded database)."""
    models = tmp_path / "models.toml"
    if not models.exists():
        models.write_text(toy_model("toy"))
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "GPUJOBS_STORAGE_DIR": str(tmp_path / "storage"),
        "GPUJOBS_MODELS_FILE": str(models),
        "GPUJOBS_GPUS": "24GiB",
        "GPUJOBS_VRAM_BUFFER_MB": "0",
        "GPUJOBS_WORKER_NAME": worker_name(f"pgr-{name}"),  # not the host's default: a worker may hold it
        "GPUJOBS_POLL_INTERVAL_S": "0.5",
        "GPUJOBS_LOG_LEVEL": "INFO",
    }


def _start(started: dict[str, subprocess.Popen[bytes]], tmp_path: Path, name: str, *args: str) -> Path:
    """Start `python -m app ARGS` as `name` on the test's storage folder; its log."""
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        started[name] = subprocess.Popen(
            [sys.executable, "-m", "app", *args],
            env=_env(tmp_path, name),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return log


def _ready(base: str, timeout_s: float, *, workers: int = 0) -> float:
    """Wait until /readyz answers 200 and counts `workers` live workers; how long that took."""
    began = time.monotonic()
    with httpx.Client(base_url=base, timeout=5) as http:
        while True:
            with contextlib.suppress(httpx.TransportError):
                ready = http.get("/readyz")
                if ready.status_code == 200 and ready.json()["workers"] >= workers:
                    return time.monotonic() - began
            assert time.monotonic() - began < timeout_s, f"/readyz not 200 within {timeout_s} s"
            time.sleep(0.1)


def _key(tmp_path: Path) -> str:
    """An admin key, made by `gpujobs keys create` on the folder (a third process joining it)."""
    made = subprocess.run(
        [sys.executable, "-m", "app", "keys", "create", "ops", "--admin"],
        env=_env(tmp_path, "keys"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def _finished(base: str, key: str, timeout_s: float) -> dict[str, object]:
    """Submit a toy job and wait until it ends; the job."""
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
        sent = http.post(
            "/jobs",
            files={"image": ("a.png", png_bytes(), "image/png")},
            data={"model": "toy", "params": json.dumps({"steps": 1})},
        )
        assert sent.status_code == 201, sent.text
        deadline = time.monotonic() + timeout_s
        while (job := http.get(f"/jobs/{sent.json()['id']}").json())["state"] not in {"succeeded", "failed"}:
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        return dict(job)


def test_serve_and_a_worker_start_a_killed_server_again_once_and_stop_it_at_the_end(tmp_path):
    """kill -9 of the postmaster under `serve` and a separate `worker`: one of them starts it again
    in the same folder (one restart in their logs, not two), /readyz is 200 again and a job runs;
    then stopping both stops the new server (the last one out, whichever restarted it)."""
    data = tmp_path / "storage" / "pgdata"
    port = _port()
    base = f"http://127.0.0.1:{port}"
    with _processes(tmp_path) as started:
        logs = {"serve": _start(started, tmp_path, "serve", "serve", "--no-worker", "--port", str(port))}
        wait_until_serving(started["serve"], base, logs["serve"])
        logs["worker"] = _start(started, tmp_path, "worker", "worker")
        key = _key(tmp_path)
        _ready(base, 60, workers=1)
        # The kill comes once the worker listens: its restart, not its first subscription, is what
        # this test is about (a connection lost while subscribing: tests/integration/test_listener_outage.py).
        _listening(data, timeout_s=30)
        first, socket_dir = _postmaster(data), _socket_dir(data)

        _kill(first)
        _ready(base, BACK_WITHIN_S)
        second = _new_postmaster(data, first, timeout_s=1)
        assert _socket_dir(data) == socket_dir  # the pools' URL still names it
        job = _finished(base, key, timeout_s=60)
        assert job["state"] == "succeeded", job
        time.sleep(2 * pgserver.WATCH_INTERVAL_S)  # each watcher has looked again since
        said = {name: log.read_text() for name, log in logs.items()}
        restarts = {name: text.count("action=pg_restarted") for name, text in said.items()}
        assert sum(restarts.values()) == 1, (restarts, said)
        assert _postmaster(data) == second and alive(second)
        [restarter] = [name for name, count in restarts.items() if count]
        other = "worker" if restarter == "serve" else "serve"

        # The one that restarted it leaves first: the other, last out, must stop a server it did
        # not start.
        for name in (restarter, other):
            started[name].send_signal(signal.SIGTERM)
            assert started[name].wait(timeout=60) in (0, 143), logs[name].read_text()[-3000:]
        deadline = time.monotonic() + 30
        while alive(second):
            assert time.monotonic() < deadline, "the server started again outlived serve and worker"
            time.sleep(0.1)
        assert not (data / "postmaster.pid").exists()


@contextlib.contextmanager
def _watched(data: Path, interval_s: float) -> Iterator[pgserver.EmbeddedPostgres]:
    """The folder's server, started and watched by this process for the block, then let go."""
    server = pgserver.EmbeddedPostgres(data)
    server.start()
    try:
        server.watch(interval_s=interval_s)
        yield server
    finally:
        server.stop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            _stop_server(_postmaster(data))


async def _logged(caplog: pytest.LogCaptureFixture, action: str, timeout_s: float) -> logging.LogRecord:
    """The first record of `action`, once there is one."""
    deadline = time.monotonic() + timeout_s
    while not (found := [r for r in caplog.records if getattr(r, "action", None) == action]):
        assert time.monotonic() < deadline, f"no {action} within {timeout_s} s"
        await asyncio.sleep(0.05)
    return found[0]


async def _answers(url: str) -> int:
    conn = await asyncpg.connect(db.asyncpg_dsn(url))
    try:
        return int(await conn.fetchval("SELECT 1"))
    finally:
        await conn.close()


async def test_the_watch_starts_a_killed_server_again_at_the_same_address(tmp_path, caplog):
    """In process: killed, the server is started again within a few intervals, at the same URL, and
    the restart is logged with how long it was down; stopped, it is not started again."""
    caplog.set_level(logging.INFO, logger="gpujobs.pgserver")
    data = tmp_path / "pgdata"
    with _watched(data, interval_s=0.2) as server:
        url = server.url()
        first = _postmaster(data)
        _kill(first)
        said = await _logged(caplog, "pg_restarted", timeout_s=15)
        assert _new_postmaster(data, first, timeout_s=0) != first
        assert server.url() == url
        assert await _answers(url) == 1
    assert len([r for r in caplog.records if getattr(r, "action", None) == "pg_restarted"]) == 1
    assert said.levelname == "WARNING" and isinstance(getattr(said, "down_s", None), float)
    assert "down" in said.getMessage()
    await asyncio.sleep(1)  # five intervals: a watch left running would have started it again
    assert not (data / "postmaster.pid").exists()


async def test_a_restart_that_fails_is_logged_and_tried_again_later_not_in_a_loop(tmp_path, caplog):
    """A server that cannot start again (here: a setting it refuses) gets one ERROR line per try,
    the tries spaced by a growing delay, and it starts once the cause is gone."""
    data = tmp_path / "pgdata"
    with _watched(data, interval_s=0.1) as server:
        settings = data / "postgresql.auto.conf"
        kept = settings.read_text()
        first = _postmaster(data)
        settings.write_text(kept + "shared_buffers = 'no such size'\n")
        _kill(first)
        await asyncio.sleep(4)
        failed = [r for r in caplog.records if getattr(r, "action", None) == "pg_restart_failed"]
        assert 1 <= len(failed) <= 3, [r.getMessage() for r in failed]  # 0.1 s apart would be ~40
        assert all(r.levelname == "ERROR" for r in failed)
        assert "postgresql.auto.conf" in failed[0].getMessage()  # the server log's last line: why
        settings.write_text(kept)
        await _logged(caplog, "pg_restarted", timeout_s=30)
        assert await _answers(server.url()) == 1
