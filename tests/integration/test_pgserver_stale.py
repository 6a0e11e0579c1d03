"""The embedded server trusts no lock file in its data folder that is not its live server's.

The wheel took the server as running whenever the process named in `postmaster.pid` existed, and
stopped that process when the last holder left. After a power cut the number may be an unrelated
process's; in a folder copied while its server ran (`cp -a`) it is the original folder's server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from app import db, pgserver
from tests.integration.test_durability import alive

REPO = Path(__file__).resolve().parents[2]

# Started in a separate process: start the server of the folder argv[1], print its URL, and hold
# it until stdin closes (then let it go: the last one out stops it) or the process is killed.
_HOLD = """
import pathlib, sys
from app import pgserver

server = pgserver.EmbeddedPostgres(pathlib.Path(sys.argv[1]))
print(server.start(), flush=True)
sys.stdin.read()
server.stop()
"""

# Started in a separate process: start the server of the folder argv[1], print its data directory
# as the server itself reports it, and stop.
_SHOW_DATA_DIRECTORY = """
import asyncio, pathlib, sys
import asyncpg
from app import db, pgserver

async def show(url):
    conn = await asyncpg.connect(db.asyncpg_dsn(url))
    try:
        print(await conn.fetchval("SHOW data_directory"))
    finally:
        await conn.close()

server = pgserver.EmbeddedPostgres(pathlib.Path(sys.argv[1]))
try:
    asyncio.run(show(server.start()))
finally:
    server.stop()
"""


@contextlib.asynccontextmanager
async def _started(server: pgserver.EmbeddedPostgres) -> AsyncIterator[str]:
    """Start `server` for the block, and stop it after. Where the block failed, a stop that fails
    too is noted on that failure rather than hiding it."""
    url = await asyncio.to_thread(server.start)
    try:
        yield url
    except BaseException as exc:
        try:
            await asyncio.to_thread(server.stop)
        except Exception as stop_exc:
            exc.add_note(f"stop() failed as well: {stop_exc!r}")
        raise
    await asyncio.to_thread(server.stop)


def _postmaster(data: Path) -> int:
    """The pid on the first line of the folder's postmaster.pid."""
    return int((data / "postmaster.pid").read_text().split()[0])


async def _data_directory(url: str) -> str:
    """The data directory of the server at `url`, as the server reports it."""
    conn = await asyncpg.connect(db.asyncpg_dsn(url))
    try:
        return str(await conn.fetchval("SHOW data_directory"))
    finally:
        await conn.close()


def _wait_gone(pids: list[int]) -> None:
    """Wait until none of `pids` is alive (zombies count as gone)."""
    deadline = time.monotonic() + 30
    for pid in pids:
        while alive(pid):
            assert time.monotonic() < deadline, f"process {pid} did not exit"
            time.sleep(0.05)


@contextlib.asynccontextmanager
async def _held(data: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """The folder's server, started by another process (yielded with the server's URL) that holds
    it for the block, and then lets it go, unless the block killed it."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD, str(data), cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        url = (await holder.stdout.readline()).decode().strip()
        assert url, "the holder did not start the server"
        yield holder, url
    finally:
        holder.stdin.close()
        await asyncio.wait_for(holder.wait(), 60)


def _cut_power(holder: int, postmaster: int) -> None:
    """SIGKILL a holder and its server, as a power cut ends them, and wait for the server's
    children: they exit once they see it gone, and until then PostgreSQL refuses to start on the
    shared memory they hold."""
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    os.kill(holder, signal.SIGKILL)
    os.kill(postmaster, signal.SIGKILL)
    _wait_gone([postmaster, *map(int, children)])


def _stop_server(postmaster: int) -> None:
    """Fast-shut-down a server the test left running (a failed run leaves no server behind)."""
    if alive(postmaster):
        os.kill(postmaster, signal.SIGINT)
    _wait_gone([postmaster])


def _copy_lock_files(source: Path, target: Path) -> None:
    """Copy the running `source` server's lock files into `target`, as `cp -a` of its folder does."""
    for lock in [source / "postmaster.pid", *source.glob(".s.PGSQL.*.lock")]:
        subprocess.run(["cp", "-a", str(lock), str(target / lock.name)], check=True)


async def test_a_pidfile_naming_an_unrelated_live_process_is_dropped(tmp_path, caplog):
    """After a power cut, the pid in postmaster.pid belonged to an unrelated process: the wheel
    took the server as running, every connection was refused, and its stop killed that process."""
    data = tmp_path / "pgdata"
    async with _held(data) as (holder, _):
        _cut_power(holder.pid, _postmaster(data))
    sleep = await asyncio.create_subprocess_exec("sleep", "600")
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        (data / "postmaster.pid").write_text("\n".join([str(sleep.pid), *lines[1:]]) + "\n")
        async with _started(pgserver.EmbeddedPostgres(data)) as url:
            assert await _data_directory(url) == str(data)
            postmaster = _postmaster(data)
            assert postmaster != sleep.pid
        assert alive(sleep.pid), "the embedded server's stop killed an unrelated process"
        _wait_gone([postmaster])  # stopped, by the last one out
    finally:
        with contextlib.suppress(ProcessLookupError):
            sleep.kill()
        await sleep.wait()
    said = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "pg_lock_file_dropped"]
    assert any(f"process {sleep.pid}" in message and "postmaster.pid" in message for message in said)


async def test_a_folder_copied_while_its_server_ran_gets_a_server_of_its_own(tmp_path):
    """`cp -a` of a storage folder while its server ran copies that server's lock files and its list
    of holders: a command on the copy used the original's database and stopped the original's
    server; past that, the copy's server outlived the copy's last process, still listed as held by
    the original's holder."""
    original, data = tmp_path / "original", tmp_path / "copy"
    async with _held(original) as (_, original_url):
        await asyncio.to_thread(subprocess.run, ["cp", "-a", str(original), str(data)], check=True)
        async with _started(pgserver.EmbeddedPostgres(data)) as url:
            assert await _data_directory(url) == str(data)
            postmaster = _postmaster(data)
        _wait_gone([postmaster])  # the copy's last process out stopped the copy's server
        assert await _data_directory(original_url) == str(original), "stop() stopped another server"


async def test_stop_signals_no_process_but_this_folders_server(tmp_path, caplog):
    """The last one out, the wheel ran `pg_ctl stop`, which signals whatever postmaster.pid names at
    that moment: a file replaced meanwhile by another server's got that server stopped."""
    other_data, data = tmp_path / "other", tmp_path / "mine"
    async with _started(pgserver.EmbeddedPostgres(other_data)) as other_url:
        mine = pgserver.EmbeddedPostgres(data)
        await asyncio.to_thread(mine.start)
        postmaster = _postmaster(data)
        try:
            shutil.copyfile(other_data / "postmaster.pid", data / "postmaster.pid")
            await asyncio.to_thread(mine.stop)
            assert await _data_directory(other_url) == str(other_data), "stop() stopped another server"
        finally:
            await asyncio.to_thread(mine.stop)
            # Left running, as its lock file no longer names it (it would stop itself within a minute).
            _stop_server(postmaster)
    assert any(getattr(r, "action", None) == "pg_stop_refused" for r in caplog.records)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="the server runs as another user as root")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop CAP_SYS_PTRACE")
async def test_without_cap_sys_ptrace_the_folders_own_server_is_still_told_apart(tmp_path):
    """Root without CAP_SYS_PTRACE (a container's root) cannot read the working folder of the
    server, which runs as the wheel's user: a process still joins its folder's live server (its
    lock file kept), and a folder with copied lock files still gets a fresh server of its own."""
    shared_data, data = tmp_path / "shared", tmp_path / "copy"
    async with _started(pgserver.EmbeddedPostgres(data)):
        pass  # made, and stopped cleanly
    async with _started(pgserver.EmbeddedPostgres(shared_data)):
        postmaster = _postmaster(shared_data)
        assert not _sees_working_folder_without_ptrace(postmaster), "CAP_SYS_PTRACE was not dropped"
        _copy_lock_files(shared_data, data)
        joined = await asyncio.to_thread(_show_without_ptrace, shared_data)
        assert joined.stdout.strip() == str(shared_data), joined.stderr
        assert _postmaster(shared_data) == postmaster and alive(postmaster)  # joined, and left running
        fresh = await asyncio.to_thread(_show_without_ptrace, data)
        assert fresh.stdout.strip() == str(data), fresh.stderr
        assert _postmaster(shared_data) == postmaster and alive(postmaster), "another server was stopped"
        assert (joined.returncode, fresh.returncode) == (0, 0), joined.stderr + fresh.stderr


# Runs a command as root without CAP_SYS_PTRACE, as a container's root (docker's default).
_NO_PTRACE = ["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"]


def _sees_working_folder_without_ptrace(pid: int) -> bool:
    """Whether a process without CAP_SYS_PTRACE can look into process `pid`'s working folder."""
    return subprocess.run([*_NO_PTRACE, "test", "-e", f"/proc/{pid}/cwd/."]).returncode == 0


def _show_without_ptrace(data: Path) -> subprocess.CompletedProcess[str]:
    """A process without CAP_SYS_PTRACE starts `data`'s server, prints the data directory the server
    reports, and stops it."""
    command = [*_NO_PTRACE, sys.executable, "-c", _SHOW_DATA_DIRECTORY, str(data)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
