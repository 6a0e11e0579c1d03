"""Ctrl-C while `gpujobs keys create` stores its key: the key is shown, or it is known not stored.

The commit is held open on purpose: a server of the test's own waits, at each commit, for a
synchronous standby that does not exist. Once the commit waits there the row is written, so a key
lost at that point is stored and never seen (it can sign nobody in and only `keys list` shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg

from app import auth
from tests.integration.test_notify_commits import own_server, until


@contextlib.asynccontextmanager
async def commits_held(raw: str) -> AsyncIterator[asyncpg.Connection]:
    """Every commit of a new session waits until the connection yielded runs `release`."""
    admin = await asyncpg.connect(raw, server_settings={"synchronous_commit": "local"})
    try:
        await admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
        await admin.execute("SELECT pg_reload_conf()")
        await until(lambda: _standby_named(raw))
        yield admin
    finally:
        await release(admin)
        await admin.close()


async def _standby_named(raw: str) -> bool:
    probe = await asyncpg.connect(raw)  # a session reads the configuration when it starts
    try:
        return await probe.fetchval("SHOW synchronous_standby_names") == "nobody"
    finally:
        await probe.close()


async def release(admin: asyncpg.Connection) -> None:
    await admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
    await admin.execute("SELECT pg_reload_conf()")


async def committing(admin: asyncpg.Connection) -> bool:
    query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
    return await admin.fetchval(query) == 1


async def start_keys_create(url: str, home: Path) -> asyncio.subprocess.Process:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "GPUJOBS_DATABASE_URL": url}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", "keys", "create", "alice",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def said_or_ended(process: asyncio.subprocess.Process, words: str) -> list[str]:
    """stderr's lines up to the first holding `words`, or up to its end."""
    assert process.stderr is not None
    lines = []
    while line := (await asyncio.wait_for(process.stderr.readline(), timeout=30)).decode():
        lines.append(line)
        if words in line:
            break
    return lines


async def stored_for(admin: asyncpg.Connection, secret: str) -> str | None:
    query = "SELECT principal FROM api_keys WHERE key_hash = $1"
    return await admin.fetchval(query, auth.hash_key(secret))


@contextlib.asynccontextmanager
async def interrupted_while_committing(
    tmp_path: Path,
) -> AsyncIterator[tuple[asyncpg.Connection, asyncio.subprocess.Process, list[str]]]:
    """`keys create` sent SIGINT once its commit waits (its row written): the admin connection that
    holds the commits, the process, and what it said on stderr up to its answer to the signal."""
    async with own_server(tmp_path / "pg") as url:
        raw = url.replace("postgresql+asyncpg://", "postgresql://")
        async with commits_held(raw) as admin:
            process = await start_keys_create(url, tmp_path)
            await until(lambda: committing(admin), timeout_s=60)
            process.send_signal(signal.SIGINT)
            yield admin, process, await said_or_ended(process, "Ctrl-C again")


async def test_ctrl_c_while_the_key_commits_still_shows_the_key(tmp_path):
    """The interrupt cancelled the commit's wait, after the row was written: the key was stored,
    and the command exited without printing it. Now the first Ctrl-C waits for the commit, the key
    is printed, and the command then exits as interrupted."""
    async with interrupted_while_committing(tmp_path) as (admin, process, told):
        await release(admin)
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
        stderr = "".join(told) + err.decode()
        assert process.returncode == 130, stderr
        [secret] = out.decode().split()
        assert await stored_for(admin, secret) == "alice", stderr
        assert "created user key" in stderr and "Traceback" not in stderr, stderr


async def test_a_second_ctrl_c_gives_up_and_says_the_key_may_be_stored(tmp_path):
    """With the database stuck, a second Ctrl-C ends the command at once, and what it says leads
    the operator to the key that may have been stored unseen."""
    async with interrupted_while_committing(tmp_path) as (_, process, told):
        process.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(process.communicate(), timeout=30)
        stderr = "".join(told) + err.decode()
        assert process.returncode == 130, stderr
        assert out == b"", stderr
        assert "gpujobs keys list" in stderr and "revoke" in stderr, stderr
        assert "Traceback" not in stderr, stderr
