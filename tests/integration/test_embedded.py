"""The embedded PostgreSQL starts from nothing in an empty folder, and is shared by processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import asyncpg

from app import db, pgserver


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
