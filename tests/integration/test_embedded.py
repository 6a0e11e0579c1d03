"""The embedded PostgreSQL starts from nothing in an empty folder, and is shared by processes."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest

from app import db, errors, pgserver
from tests.conftest import free_port, wait_until_serving, worker_name
from tests.integration.test_durability import alive

# Tags of a POSIX ACL's entries (linux/posix_acl.h), and the id of those that name no one.
_ACL_USER, _ACL_GROUP_OBJ, _ACL_OTHER = 0x02, 0x04, 0x20
_NO_ID = 0xFFFFFFFF


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


async def test_embedded_server_starts_in_a_folder_whose_path_has_a_space(tmp_path):
    """`make run` in a checkout under a folder such as "My Projects" stopped at once: "the embedded
    PostgreSQL ... did not start: ... postgres: invalid argument: "Projects/gpujobs/storage/pgdata""
    (the wheel hands pg_ctl the socket folder unquoted in `-o`). Every command on the embedded
    database failed so (serve, worker, keys, migrate)."""
    data = tmp_path / "My Projects" / "storage" / "pgdata"
    server = pgserver.EmbeddedPostgres(data)
    try:
        url = await asyncio.to_thread(server.start)
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        assert int(await conn.fetchval("SHOW server_version_num")) >= 140000
        await conn.close()
    finally:
        server.stop()
    assert not (data / "postmaster.pid").exists()


def test_a_server_that_does_not_start_is_said_to_fail_for_its_reason(tmp_path):
    """The error named pg_ctl's command and its exit status, and left the reason in the log: "the
    embedded PostgreSQL in … did not start (Command '[…pg_ctl…]' returned non-zero exit status
    1.); see …/log". It says the server's own FATAL line and its DETAIL now."""
    data = tmp_path / "pgdata"
    server = pgserver.EmbeddedPostgres(data)
    server.start()
    server.stop()
    (data / "PG_VERSION").write_text("99\n")  # a folder of another major version
    with pytest.raises(errors.ConfigError) as failed:
        pgserver.EmbeddedPostgres(data).start()
    assert failed.value.message == (
        f"the embedded PostgreSQL in {data} did not start: FATAL: database files are incompatible"
        " with server DETAIL: The data directory was initialized by PostgreSQL version 99, which is"
        f" not compatible with this version {server_version(data)}.; its whole log: {data / 'log'}"
    )


def server_version(data: Path) -> str:
    """The wheel's PostgreSQL version, as its log's first line said it ("starting PostgreSQL 18.6 …")."""
    first = next(line for line in (data / "log").read_text().splitlines() if "starting PostgreSQL" in line)
    return first.split("starting PostgreSQL ")[1].split()[0]


def test_a_start_failure_is_read_from_the_servers_last_run_only(tmp_path):
    log = tmp_path / "log"
    earlier = '2026-11-28 04:00:00.000 UTC [10] FATAL:  role "nobody" does not exist\n'
    ended = "2026-11-28 04:00:01.000 UTC [9] LOG:  database system is shut down\n"
    log.write_text(earlier + ended)
    assert pgserver.start_failure(log) is None  # the earlier run's client error is not the reason
    log.write_text(
        earlier
        + ended
        + "2026-11-28 04:01:00.000 UTC [11] PANIC:  could not locate a valid checkpoint record\n"
    )
    assert pgserver.start_failure(log) == "PANIC: could not locate a valid checkpoint record"
    assert pgserver.start_failure(tmp_path / "none") is None


@pytest.mark.parametrize(
    ("sig", "code", "ignored"),
    [
        (signal.SIGTERM, 143, False),
        (signal.SIGHUP, 143, False),
        (signal.SIGINT, 130, False),
        (signal.SIGINT, 130, True),
    ],
    ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGINT ignored at start"],
)
def test_serve_stops_its_embedded_server_on_sigterm(tmp_path, sig, code, ignored):
    """`gpujobs serve` with no database URL starts the embedded server and, on SIGTERM (docker stop,
    systemd, kill), shuts down and stops that server. uvicorn re-raises the signal after its
    graceful shutdown; with the default handler the process died there and left the server up.
    SIGHUP (the terminal that ran `make run` closed) killed it outright, the server left up: it
    is taken as SIGTERM. Ctrl-C (SIGINT) stops it the same way, with exit code 130, also when
    serve started with SIGINT ignored (a shell's background job; a test process had it so once):
    uvicorn's raising it again was ignored then, and serve exited 0."""
    storage = tmp_path / "storage"
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "GPUJOBS_STORAGE_DIR": str(storage),
        "GPUJOBS_GPUS": "24GiB",
        "GPUJOBS_LOG_LEVEL": "WARNING",
        "GPUJOBS_WORKER_NAME": worker_name("embedded"),  # not the host's default: a worker may hold it
    }
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=out,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None,
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


def _acl(folder: Path) -> dict[tuple[int, int], int]:
    """The POSIX access ACL of `folder` as {(tag, id): perms}; {} when it has none."""
    try:
        raw = os.getxattr(folder, "system.posix_acl_access")
    except OSError:
        return {}
    return {(tag, ident): perm for tag, perm, ident in struct.iter_unpack("<HHI", raw[4:])}


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="the wheel widens modes only as root")
async def test_embedded_server_as_root_opens_no_folder_above_its_storage_to_other_users(tmp_path, caplog):
    """As root, the wheel runs PostgreSQL as its own user and, to let it through, did `chmod
    g+rx,o+rx` on every folder above the data folder up to `/`: a checkout in /root (0700) left
    /root 0755, readable by every local user, silently. Now the wheel's user alone is given
    search (x) through an ACL entry on the folders it could not pass, and their modes stay."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)  # whatever the umask
    secret = home / "notes.txt"
    secret.write_text("secret")
    secret.chmod(0o644)
    data = home / "storage" / "pgdata"
    server = pgserver.EmbeddedPostgres(data)
    url = await asyncio.to_thread(server.start)
    try:
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        assert await conn.fetchval("SELECT 1") == 1
        await conn.close()
    finally:
        server.stop()
    mode = stat.S_IMODE(home.stat().st_mode)
    assert mode & 0o707 == 0o700, oct(mode)  # the group bits show the ACL's mask
    acl = _acl(home)
    uid = pwd.getpwnam(pgserver.SYSTEM_USER).pw_uid
    assert acl[(_ACL_USER, uid)] == 1  # x for the wheel's user, nothing more
    assert acl[(_ACL_GROUP_OBJ, _NO_ID)] == 0  # the folder's group gained nothing
    assert acl[(_ACL_OTHER, _NO_ID)] == 0
    nobody = await asyncio.to_thread(subprocess.run, ["cat", str(secret)], user="nobody", capture_output=True)
    assert nobody.returncode != 0 and nobody.stdout == b""
    [said] = [r for r in caplog.records if getattr(r, "action", None) == "pg_search_granted"]
    assert said.levelname == "WARNING" and str(home) in said.getMessage()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="the wheel widens modes only as root")
def test_embedded_server_as_root_stops_where_no_acl_can_be_set_and_says_what_to_do(tmp_path):
    """Where the wheel's user cannot pass a folder that takes no ACL entry (here an immutable one,
    as a file system without ACLs refuses them), the start stops with one line naming the folder
    and the ways out. Before, the wheel's `chmod` failed there with a bare "did not start
    (Operation not permitted)", and where the chmod succeeded it opened the folder to all."""
    home = tmp_path / "home"
    (home / "storage").mkdir(parents=True)
    home.chmod(0o700)
    if subprocess.run(["chattr", "+i", str(home)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        with pytest.raises(errors.ConfigError) as caught:
            pgserver.EmbeddedPostgres(home / "storage" / "pgdata").start()
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
    finally:
        subprocess.run(["chattr", "-i", str(home)], check=True)
    message = caught.value.message
    assert f"cannot pass through {home} (mode 0700)" in message
    assert f"chmod o+x {home}" in message and "GPUJOBS_DATABASE_URL" in message
    assert "\n" not in message
