"""The embedded PostgreSQL starts from nothing in an empty folder, and is shared by processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import asyncpg
import pytest

from app import db, pgserver
from tests.conftest import free_port, wait_until_serving
from tests.integration.test_durability import alive


async def test_embedded_server_starts_from_nothing_and_is_shared(tmp_path):
    data = tmp_path / "fresh" / "pgdata"
    server = pgserver.EmbeddedPostgres(data)
    url = await asyncio.to_thread(server.start)
    try:
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        version = await conn.fetchval("SHOW server_version_num")
        await conn.close()
        assert int(version) >= 140000
        assert (data / "PG_VERSION").exists()
        # A second process opens the same folder: it joins the running server and leaves it running.
        code = (
            "from app import pgserver; import pathlib, sys; "
            f"s = pgserver.EmbeddedPostgres(pathlib.Path({str(data)!r})); print(s.start()); s.stop()"
        )
        command = [sys.executable, "-c", code]
        other = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
        assert other.stdout.strip() == url
        conn = await asyncpg.connect(db.asyncpg_dsn(url))  # still up after the other process left
        await conn.close()
    finally:
        server.stop()
    assert not (data / "postmaster.pid").exists()  # the last one out stopped it


@pytest.mark.parametrize(
    ("sig", "code"),
    [(signal.SIGTERM, 143), (signal.SIGHUP, 143), (signal.SIGINT, 130)],
    ids=["SIGTERM", "SIGHUP", "SIGINT"],
)
def test_serve_stops_its_embedded_server_on_sigterm(tmp_path, sig, code):
    """`gpujobs serve` with no database URL starts the embedded server and, on SIGTERM (docker stop,
    systemd, kill), shuts down and stops that server. uvicorn re-raises the signal after its
    graceful shutdown; with the default handler the process died there and left the server up.
    SIGHUP (the terminal that ran `make run` closed) killed it outright, the server left up: it
    is taken as SIGTERM. Ctrl-C (SIGINT) stops it the same way, with exit code 130."""
    storage = tmp_path / "storage"
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "GPUJOBS_STORAGE_DIR": str(storage),
        "GPUJOBS_GPUS": "24GiB",
        "GPUJOBS_LOG_LEVEL": "WARNING",
    }
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", str(port)], env=env, stdout=out, stderr=out
        )
    postmaster = None
    try:
        wait_until_serving(serve, f"http://127.0.0.1:{port}", log)
        pid_file = storage / "pgdata" / "postmaster.pid"
        postmaster = int(pid_file.read_text().split()[0])
        serve.send_signal(sig)
        assert serve.wait(timeout=30) == code, log.read_text()
        assert "Aborted" not in log.read_text()
        deadline = time.monotonic() + 10
        while alive(postmaster):
            assert time.monotonic() < deadline, "the embedded PostgreSQL outlived serve"
            time.sleep(0.1)
        assert not pid_file.exists()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        if postmaster is not None and alive(postmaster):  # a failed run leaves no server behind
            os.kill(postmaster, signal.SIGQUIT)


def test_a_process_that_died_holding_the_embedded_server_does_not_keep_it_up(tmp_path):
    """The wheel stops the server when the last process in its list of holders leaves, and never
    dropped one that died without leaving (kill -9, the OOM killer, a power cut): from then on no
    process stopped the server again, `serve` on SIGTERM included."""
    data = tmp_path / "pgdata"
    server = pgserver.EmbeddedPostgres(data)
    server.start()
    holders = data / ".handle_pids.json"
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()
        holders.write_text(json.dumps([*json.loads(holders.read_text()), dead.pid]))  # died holding it
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while alive(postmaster):
        assert time.monotonic() < deadline, "the embedded PostgreSQL outlived its last live holder"
        time.sleep(0.1)
    assert json.loads(holders.read_text()) == []
