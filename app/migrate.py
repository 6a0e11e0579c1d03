"""Schema migrations through Alembic, callable from the CLI and the tests.

Checking the schema (`head`, `current`) needs no Alembic: every worker and API process checks it at
start, and importing Alembic costs a process about 0.13 s of CPU. Alembic runs the migrations.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from sqlalchemy import exc, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from app import checkout, errors

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

# One process migrates at a time (migrations/env.py holds this session advisory lock throughout):
# `serve` and a `worker` started together on a new data folder both migrate.
MIGRATE_LOCK_KEY = 0x67706A_6D696772  # "gpj" "migr"
LOCK_TRY_EVERY_S = 0.5  # how often a process waiting for a migration tries its lock
LOCK_REMIND_S = 60.0  # and says again that it waits, and for whom
log = logging.getLogger("gpujobs.migrate")
VERSIONS = checkout.ROOT / "migrations" / "versions"
# `revision: str = "0004"` and `down_revision: str | None = "0003"` (or None) in a migration script.
_REVISION = re.compile(
    r"^(down_)?revision\b[^=\n]*=\s*(?:\"([^\"\n]+)\"|'([^'\n]+)'|(None))\s*$", re.MULTILINE
)


def alembic_config(url: str) -> Config:
    """Alembic configuration for the project's migrations and this database."""
    from alembic.config import Config

    scripts = _versions().parent
    config = Config(str(scripts.parent / "alembic.ini"))
    config.set_main_option("script_location", str(scripts))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> str | None:
    """Bring the database to `revision` (default: the newest); returns the revision it is at. A
    database a newer release migrated is left alone: as it is when its record says this code runs
    on it (see `runs_on`), else a ConfigError that says so."""
    import asyncio

    from alembic import command

    from app import db

    async def found() -> tuple[Schema, list[str]]:
        engine = db.create_engine(url, pool_size=1)
        try:
            # Read while no other process migrates: between its first commit and its record of
            # the revision, ours looked like tables no one made.
            async with in_turn(engine):
                return await schema(engine), await _our_tables(engine)
        finally:
            await engine.dispose()

    (at, oldest), ours = asyncio.run(found())
    if at is not None and at not in known() and not ours:  # not a newer gpujobs: no table of ours
        raise errors.ConfigError(
            f"the database records the Alembic revision {at} but holds no table of gpujobs: another "
            "application's database; migrate an empty database (GPUJOBS_DATABASE_URL)"
        )
    if revision == "head" and at is not None and at not in known() and runs_on(at, oldest):
        log.info(
            "the database schema is at %s, ahead of this code's %s, which runs on it: left as it is",
            at, head(), extra={"action": "schema_ahead"},
        )  # fmt: skip
        return at
    check_known(at)
    unrecorded = ours if at is None else []
    if unrecorded:
        raise errors.ConfigError(
            _UNRECORDED.format(what=f"tables named as gpujobs's ({', '.join(unrecorded)})")
        )
    try:
        command.upgrade(alembic_config(url), revision)
        return head() if revision == "head" else revision
    except exc.ProgrammingError as error:  # a type or index of ours there: one transaction, undone
        if at is not None or getattr(error.orig, "sqlstate", None) not in _ALREADY_EXISTS:
            raise
        reason = (str(error.orig).strip().splitlines() or ["already exists"])[0]
        what = f"objects named as gpujobs's ({reason.split(': ')[-1]})"
        raise errors.ConfigError(_UNRECORDED.format(what=what)) from error


# Never migrated (no alembic_version), yet holding what the first migration creates: its CREATE
# failed with SQLAlchemy's traceback. duplicate_table, duplicate_object (a type, a constraint).
_ALREADY_EXISTS = frozenset({"42P07", "42710"})
_UNRECORDED = (
    "the database holds {what} but no alembic_version: gpujobs did not create them, or their record "
    "of migrations was dropped; migrate an empty database (GPUJOBS_DATABASE_URL), or drop them first"
)


async def _our_tables(engine: AsyncEngine) -> list[str]:
    """The tables of the schema migrations create in whose names are gpujobs's tables' names."""
    from app import db, tables

    assert tables  # imported for its side effect: the tables register on Base.metadata
    names = sorted(db.Base.metadata.tables)
    async with engine.connect() as conn:
        found = await conn.scalars(
            text(
                "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
                " AND relname = ANY(:names) ORDER BY relname"
            ),
            {"names": names},
        )
        return list(found)


def downgrade(url: str, revision: str = "base") -> None:
    """Take the database back to `revision`."""
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def head() -> str | None:
    """The newest revision the code knows: the one no other script names as its parent.

    Read from the scripts' text; a script this cannot read (a merge's tuple of parents, say) sends
    the question to Alembic, and so would more than one head (Alembic then says what is wrong)."""
    revisions = _parents()
    heads = set(revisions or {}) - set((revisions or {}).values())
    if revisions is None or len(heads) != 1:
        return _alembic_head()
    return heads.pop()


def known() -> set[str]:
    """Every revision the code's migration scripts define."""
    revisions = _parents()
    if revisions is None:
        return {script.revision for script in _scripts().walk_revisions()}
    return set(revisions)


class Schema(NamedTuple):
    """What a database says of its schema: its revision, and the oldest code that runs on it (the
    record a migration leaves, `record_oldest_code`; None before there was one)."""

    at: str | None
    oldest_code: str | None


def runs_on(at: str | None, oldest_code: str | None) -> bool:
    """Whether this code runs on a schema at `at`: its own head, or a newer release's whose record
    names a revision this code knows as the oldest code that runs on it (a migration that only
    adds, as during a rolling upgrade: docs/operations.md, "Upgrading")."""
    if at is not None and at == head():
        return True
    return at is not None and at not in known() and oldest_code is not None and oldest_code in known()


def check_known(found: str | None) -> None:
    """Refuse a database at a revision the code does not know: a newer release migrated it, and
    neither this code nor its migrations can use it (nor take it back)."""
    if found is not None and found not in known():
        raise errors.ConfigError(
            f"the database schema is at {found}, which this version of gpujobs does not know (its "
            f"newest is {head()}): a newer release migrated it; run that release, or downgrade the "
            f"database to {head()} with it first"
        )


def _parents() -> dict[str, str | None] | None:
    """Each script's revision and its parent, read from the scripts' text (None: one is unreadable)."""
    revisions: dict[str, str | None] = {}
    for script in sorted(_versions().glob("*.py")):
        found = {m.group(1) or "": m.group(2) or m.group(3) for m in _REVISION.finditer(script.read_text())}
        if set(found) != {"", "down_"} or found[""] is None:
            return None
        revisions[found[""]] = found["down_"]
    return revisions


def _versions() -> Path:
    """The migration scripts' folder; a ConfigError saying how to install when it is missing."""
    if not VERSIONS.is_dir():
        raise errors.ConfigError(
            f"no migration scripts at {VERSIONS}: gpujobs runs from its source tree, which holds "
            "migrations/ and alembic.ini (a wheel holds neither); install it with `pip install -e .` "
            "in a checkout, as the Dockerfile does"
        )
    return VERSIONS


def _alembic_head() -> str | None:
    return _scripts().get_current_head()


def _scripts() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(""))


@contextlib.asynccontextmanager
async def in_turn(engine: AsyncEngine) -> AsyncIterator[None]:
    """Hold the migration lock for the block, after a migration under way (another process holds
    it throughout, migrations/env.py): a schema read meanwhile is read half-way, behind the code."""
    import asyncio

    async with engine.connect() as lock:
        key = {"key": MIGRATE_LOCK_KEY}
        waited_s = 0.0
        # Tries between transactions, never waits inside a statement: that holds a snapshot, and a
        # migration's CREATE INDEX CONCURRENTLY waits for every older one (each waits for the other).
        while not await lock.scalar(text("SELECT pg_try_advisory_lock(:key)"), key):
            if waited_s % LOCK_REMIND_S < LOCK_TRY_EVERY_S:  # at once, then now and then: no silent hang
                holder = (await lock.execute(_LOCK_HOLDER, key)).first()
                log.warning(
                    "a migration is under way (another process holds the migration lock): waiting for "
                    "it (%.0f s so far; held by PostgreSQL process %s, %s)",
                    waited_s, *(holder or ("?", "?")), extra={"action": "migration_wait"},
                )  # fmt: skip
            await lock.commit()
            await asyncio.sleep(LOCK_TRY_EVERY_S)
            waited_s += LOCK_TRY_EVERY_S
        await lock.commit()
        try:
            yield
        finally:
            await lock.execute(text("SELECT pg_advisory_unlock(:key)"), key)
            await lock.commit()


# Who holds the migration lock: a bigint advisory lock is (classid, objid) = its high and low halves.
_LOCK_HOLDER = text(
    "SELECT l.pid, coalesce(nullif(a.application_name, ''), 'no application_name')"
    " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    " AND l.classid::bigint = (CAST(:key AS bigint) >> 32)"
    " AND l.objid::bigint = (CAST(:key AS bigint) & 4294967295)"
)


def take_lock(connection: Connection) -> None:
    """Take the migration lock on `connection` (migrations/env.py), as `in_turn` does: by tries
    between transactions, so that the wait holds no snapshot."""
    import time

    key = {"key": MIGRATE_LOCK_KEY}
    while not connection.scalar(text("SELECT pg_try_advisory_lock(:key)"), key):
        connection.commit()
        time.sleep(LOCK_TRY_EVERY_S)
    connection.commit()


# The record of the oldest code that runs on the schema: the comment on alembic_version, written
# in each migration's transaction (migrations/env.py), so that code a newer release finds running
# reads it without knowing that release's scripts. A comment needs no table of its own.
# It names the revision it was written at: a revision changed by other means leaves it stale.
_RECORD = "gpujobs: code from revision {oldest} on runs on this schema, at revision {at}"
_RECORD_READ = re.compile(r"^gpujobs: code from revision (\S+) on runs on this schema, at revision (\S+)$")
# `oldest_code = "0009"` in a migration script: the oldest code (by its head) that runs on the
# schema the script makes. A script without it: its own revision (the code before it does not).
OLDEST_CODE_ATTRIBUTE = "oldest_code"


def oldest_code(revision: str, scripts: ScriptDirectory | None = None) -> str:
    """The oldest code that runs on the schema at `revision`: the newest of what each migration up
    to it declares, since the code must run on what every one of them made. `scripts`: the
    migrations Alembic runs (default: the checkout's)."""
    scripts = scripts or _scripts()
    chain = list(reversed(list(scripts.iterate_revisions(revision, "base"))))  # oldest first
    position = {script.revision: i for i, script in enumerate(chain)}
    declared = []
    for script in chain:
        wanted = getattr(script.module, OLDEST_CODE_ATTRIBUTE, script.revision)
        if position.get(wanted, len(chain)) > position[script.revision]:
            raise errors.ConfigError(
                f"migration {script.revision} declares {OLDEST_CODE_ATTRIBUTE} = {wanted!r}, which is "
                "not a revision at or before it"
            )
        declared.append(wanted)
    return max(declared, key=position.__getitem__)


def record_oldest_code(connection: Connection, scripts: ScriptDirectory) -> None:
    """Write, in the migration's own transaction, the oldest code that runs on the schema now."""
    if connection.scalar(text("SELECT to_regclass('alembic_version')")) is None:
        return  # downgraded to nothing
    at = connection.scalar(text("SELECT version_num FROM alembic_version"))
    if at is None:
        return
    try:
        with connection.begin_nested():  # a refused COMMENT undoes only itself
            connection.execute(text(record(at, scripts)))
    except exc.ProgrammingError as error:
        if getattr(error.orig, "sqlstate", None) != "42501":  # insufficient_privilege
            raise
        # Only alembic_version's owner may comment on it: a stamp by another role still stands,
        # with no record, and code older than it refuses the schema, as it would without one.
        log.warning(
            "the record of the oldest code that runs on schema %s was not written: the database user "
            "does not own alembic_version",
            at, extra={"action": "schema_record_refused"},
        )  # fmt: skip


def record(at: str, scripts: ScriptDirectory) -> str:
    """The statement that records the oldest code that runs on the schema at `at` (offline mode,
    `alembic upgrade --sql`, writes it into its script: migrations/env.py)."""
    comment = _RECORD.format(oldest=oldest_code(at, scripts), at=at).replace("'", "")
    return f"COMMENT ON TABLE alembic_version IS '{comment}'"


async def schema(engine: AsyncEngine) -> Schema:
    """The database's revision and its record of the oldest code that runs on it."""
    at = await current(engine)
    if at is None:
        return Schema(None, None)
    async with engine.connect() as conn:
        comment = await conn.scalar(
            text("SELECT obj_description(to_regclass('alembic_version'), 'pg_class')")
        )
    found = _RECORD_READ.match(comment or "")
    return Schema(at, found.group(1) if found and found.group(2) == at else None)


async def current(engine: AsyncEngine) -> str | None:
    """The revision the database is at (None: never migrated)."""
    async with engine.connect() as conn:
        if await conn.scalar(text("SELECT to_regclass('alembic_version')")) is None:
            return None
        versions = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars().all()
    if len(versions) > 1:
        raise errors.ConfigError(f"the database is at several revisions at once ({', '.join(versions)})")
    return versions[0] if versions else None
