"""On the embedded database only `serve`, `worker` and `migrate` upgrade a schema: `gpujobs keys`
checks it, and migrates only a database never migrated (a new storage folder, which no `serve` uses).

Every command migrated the embedded database at start: `gpujobs keys list` of a newer checkout
upgraded the schema under an older `serve` still using the same storage folder. `serve` migrating a
fresh folder is shown by tests/integration/test_embedded.py's
test_serve_stops_its_embedded_server_on_sigterm (its `serve` answers only with the schema at head).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from alembic.script import ScriptDirectory

from app import db, migrate, pgserver
from tests.integration.test_client import run_cli


def _previous(revision: str | None) -> str:
    """The revision before `revision` (head's parent: a schema one release behind the code)."""
    scripts = ScriptDirectory.from_config(migrate.alembic_config(""))
    parent = scripts.get_revision(revision).down_revision
    assert isinstance(parent, str), parent
    return parent


async def _revision(url: str) -> str | None:
    engine = db.create_engine(url, pool_size=1)
    try:
        return await migrate.current(engine)
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def _held(data: Path) -> AsyncIterator[str]:
    """The folder's embedded server, held by this process for the block (as an older `serve` holds
    it); its URL."""
    server = pgserver.EmbeddedPostgres(data)
    url = await asyncio.to_thread(server.start)
    try:
        yield url
    finally:
        await asyncio.to_thread(server.stop)


def _env(tmp_path: Path, storage: Path) -> dict[str, str]:
    """A command's environment on the embedded database of `storage` (no GPUJOBS_DATABASE_URL)."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
    return env | {"GPUJOBS_STORAGE_DIR": str(storage), "GPUJOBS_GPUS": "8GiB"}


async def test_keys_on_a_schema_one_revision_behind_say_to_migrate_and_change_nothing(tmp_path):
    """A newer checkout's `gpujobs keys list` upgraded the schema under the older `serve` that
    held the folder's server; now each key command exits 2 with one line saying to migrate."""
    storage = tmp_path / "storage"
    behind = _previous(migrate.head())
    async with _held(storage / "pgdata") as url:
        await asyncio.to_thread(migrate.upgrade, url, behind)
        env = _env(tmp_path, storage)
        for args in (["keys", "list"], ["keys", "create", "alice"], ["keys", "revoke", "1"]):
            code, stdout, stderr = await run_cli(env, *args, timeout_s=120)
            assert await _revision(url) == behind, (args, stderr[-3000:])
            assert code == 2 and stdout == "" and "Traceback" not in stderr, (args, code, stderr[-3000:])
            [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert f"schema is at {behind}" in line and "run `gpujobs migrate`" in line, line
        # `gpujobs migrate` is the command that moves it (the operator's choice, once the old
        # `serve` is stopped or can take it); keys then work.
        code, stdout, stderr = await run_cli(env, "migrate", timeout_s=120)
        assert code == 0 and f"database at revision {migrate.head()}" in stdout, stderr[-3000:]
        assert await _revision(url) == migrate.head()
        code, stdout, stderr = await run_cli(env, "keys", "list", timeout_s=120)
        assert code == 0 and "principal" in stdout, stderr[-3000:]


async def test_keys_create_on_a_fresh_folder_migrates_it_and_makes_the_key(tmp_path):
    """A first key made before anything ran on the storage folder (the README's quick start): the
    never-migrated database is brought to head, the key printed alone on stdout and usable. (A
    schema one behind is still refused, unchanged: the test above.)"""
    storage = tmp_path / "storage"
    env = _env(tmp_path, storage)
    code, stdout, stderr = await run_cli(env, "keys", "create", "alice", timeout_s=120)
    assert code == 0 and "Traceback" not in stderr, stderr[-3000:]
    [secret] = stdout.splitlines()
    assert f"migrated the new embedded database to revision {migrate.head()}" in stderr, stderr[-3000:]
    async with _held(storage / "pgdata") as url:
        assert await _revision(url) == migrate.head()
    code, stdout, stderr = await run_cli(env, "keys", "list", timeout_s=120)
    assert code == 0 and "alice" in stdout and secret[:8] in stdout, (stdout, stderr[-3000:])
    assert "migrated" not in stderr, stderr[-3000:]  # once only: now it is at head
