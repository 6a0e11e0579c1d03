"""The `gpujobs` command: serve, worker, migrate, models, keys; submit, jobs, prune (the HTTP client)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from app import cli_jobs, cli_keys, cli_prune, cli_submit, errors, logs, modelsfile, pgserver, sigterm

if TYPE_CHECKING:
    from pathlib import Path

    from app.migrate import Schema
    from app.queue.worker import Worker
    from app.registry import Registry
    from app.settings import Settings

# The settings (pydantic-settings) and SQLAlchemy with what stands on it (app.db, app.migrate, the
# queue) are imported by the commands that use them: the client commands (submit, jobs, prune)
# speak HTTP only, and loading those made every `gpujobs jobs list` wait 0.6 s before its request.

cli = typer.Typer(help="gpujobs: a durable job service for GPU models.", no_args_is_help=True)
cli.add_typer(cli_keys.keys, name="keys")
# submit, jobs list|show|cancel|retry, prune: the HTTP client (app/client.py)
cli.command()(cli_submit.submit)
cli.add_typer(cli_jobs.jobs, name="jobs")
cli.command()(cli_prune.prune)
log = logging.getLogger("gpujobs.cli")
# Linux refuses a limit on open files above fs.nr_open (1048576 by default), "unlimited" included.
MAX_OPEN_FILES = 1 << 20


def _setup_logging(settings: Settings) -> None:
    logs.setup(settings.log_level, settings.log_format, stream=sys.stderr)


def _settings() -> Settings:
    from app import variables
    from app.settings import get_settings

    try:
        settings = get_settings()
    except errors.ConfigError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from exc
    _setup_logging(settings)
    for line in variables.unknown_variables(os.environ):  # a misspelt name is dropped, not refused
        log.warning("%s", line, extra={"action": "unknown_setting"})
    return settings


def _more_open_files() -> None:
    """Raise this process's soft limit on open files to its hard limit (as Go's runtime does).

    Every connection holds a descriptor, and the soft limit is often 1024 (systemd's services,
    Docker's containers) where the hard one allows far more: a thousand event streams, or slow
    clients, left the API unable to accept another connection. Nothing here uses select()."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _usable_storage(settings: Settings, *, folders: bool = False) -> None:
    """Make the storage folder if missing and check it takes files, and with `folders` make those
    serve and worker keep in it; else exit 2 naming the setting (a file there, or a folder this
    user cannot write, crashed deep inside the start-up)."""
    import tempfile

    from app import storage

    path = settings.storage_dir
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise _fail(storage.unusable(path, exc)) from exc
    if folders:
        try:
            storage.ResultStore(path)  # a file named `logs` in the way, say
        except errors.ConfigError as exc:
            raise _fail(exc) from exc


def _usable_models(settings: Settings) -> Registry:
    """The models file's registry; exit 2 with what to fix for one that cannot be used, before the
    database starts (on a fresh storage folder, the embedded one would be made and migrated first)."""
    try:
        return modelsfile.load_registry(settings.models_file)
    except errors.AppError as exc:
        raise _fail(exc) from exc


@contextlib.contextmanager
def database(settings: Settings, *, upgrade: bool = False) -> Iterator[Settings]:
    """Settings with a database URL: the configured one, or the embedded server, which is watched
    (started again if it dies) and stopped on the way out, SIGTERM and SIGHUP included, and with
    `upgrade` migrated first (an external database only by `gpujobs migrate`). A database that
    cannot be reached, or refuses the connection, ends the command with a message (exit code 2),
    not a traceback.

    `serve` and `worker` ask for `upgrade`, so that a fresh storage folder works out of the box;
    `keys` does not: run from a newer checkout, it upgraded the schema under an older `serve`
    still using the folder (it migrates only a database never migrated, app/cli_keys.py)."""
    if settings.database_url:
        with sigterm.exit_on_sigterm(), _connection_errors(settings.database_url):
            yield settings
        return
    from app import migrate

    _usable_storage(settings)
    server = pgserver.EmbeddedPostgres(settings.storage_dir / "pgdata")
    with sigterm.exit_on_sigterm():
        url = server.start()
        try:
            server.watch()
            with _connection_errors(url):
                if upgrade:
                    migrate.upgrade(url)
                yield settings.model_copy(update={"database_url": url})
        finally:
            server.stop()


# How long a worker stopped at once waits for its connections to close.
DISPOSE_NOW_S = 2.0

# SQLSTATE classes of a connection PostgreSQL turned away: 28 (authentication), 3D (no such database).
_REFUSED_CLASSES = ("28", "3D")
# SQLSTATE of a statement the database user has no right to (on a table, or CREATE on a schema).
_NO_RIGHT = "42501"


@contextlib.contextmanager
def _connection_errors(url: str) -> Iterator[None]:
    """Turn a database that is away, or that refuses the connection, into `error: ...` and exit 2."""
    from app import db

    try:
        yield
    except Exception as exc:
        cause = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the driver's error
        code = getattr(cause, "pgcode", None) or getattr(cause, "sqlstate", None)
        if db.is_unavailable(exc):
            what = "cannot reach the database"
        elif isinstance(code, str) and code[:2] in _REFUSED_CLASSES:
            what = "the database refused the connection"
        elif code == _NO_RIGHT:
            what = f"the database user {_user(url)!r} lacks a right it needs (docs/operations.md)"
        else:
            raise
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        typer.echo(f"error: {what} at {_shown(url)}: {reason}", err=True)
        raise typer.Exit(2) from exc


def _user(url: str) -> str | None:
    from sqlalchemy.engine import make_url

    return make_url(url).username


def _shown(url: str) -> str:
    """A database URL as a message may show it: its password (in the user part or the query) masked."""
    from sqlalchemy.engine import make_url

    with contextlib.suppress(Exception):  # only shown: the mask below applies all the same
        url = make_url(url).render_as_string(hide_password=True)
    return logs.mask(url)


async def _schema_at(url: str) -> Schema:
    """The schema of the database at `url` (its revision None: never migrated)."""
    from app import db, migrate

    engine = db.create_engine(url, pool_size=1)
    try:
        async with migrate.in_turn(engine):  # a migration under way: its end, not its middle
            return await migrate.schema(engine)
    finally:
        await engine.dispose()


async def _check_schema(url: str) -> None:
    from app import migrate

    found, oldest_code = await _schema_at(url)
    if migrate.runs_on(found, oldest_code):
        return
    migrate.check_known(found)
    if found != migrate.head():
        raise errors.ConfigError(
            f"the database schema is at {found or 'nothing'}, the code needs {migrate.head()}: "
            "run `gpujobs migrate`"
        )


def _fail(exc: errors.AppError) -> typer.Exit:
    typer.echo(f"error: {exc.message}", err=True)
    return typer.Exit(2)


@cli.command()
def serve(
    worker: Annotated[
        bool | None,
        typer.Option(
            help="Also run a worker in this process (default: GPUJOBS_RUN_WORKER, true)", show_default=False
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default GPUJOBS_HOST)")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port (default GPUJOBS_PORT)")] = None,
    processes: Annotated[
        int | None,
        typer.Option(min=1, max=64, help="API processes on the port (default GPUJOBS_API_PROCESSES, 1)"),
    ] = None,
) -> None:
    """Run the HTTP API (and, by default, a worker beside it)."""
    from app import apiserver

    settings = _settings()
    _more_open_files()
    if worker is not None:  # the flag overrides GPUJOBS_RUN_WORKER; without it, the setting holds
        settings = settings.model_copy(update={"run_worker": worker})
    count = processes if processes is not None else settings.api_processes
    _usable_storage(settings, folders=True)
    code = _serve_on(settings, (host or settings.host, port if port is not None else settings.port), count)
    # Several processes: a failed worker's process is started again; their exit 1 is a forced stop.
    if code == apiserver.WORKER_FAILED and count == 1:
        typer.echo("error: the in-process worker stopped after an error (see the log above)", err=True)
    if code:
        raise typer.Exit(code)


def _serve_on(settings: Settings, where: tuple[str, int], count: int) -> int:
    """Take the address, check the settings, start the database and check its schema, then serve
    with `count` API processes until stopped; the exit code."""
    from app import serve as serve_
    from app.api.main import check_settings

    try:
        # The address first: nothing starts (the database, the worker) when it cannot be had.
        with serve_.listen(*where) as sock:
            # Refused here in one line, not by each API process's start-up in a traceback (and
            # the link secret's file exists before several processes read it); before the
            # database, which on a fresh storage folder would be made and migrated first.
            check_settings(settings)
            with database(settings, upgrade=True) as ready:
                asyncio.run(_check_schema(ready.database_url or ""))
                return serve_.run(ready, count, sock)
    except errors.AppError as exc:
        raise _fail(exc) from exc


@cli.command()
def worker(
    burst: Annotated[bool, typer.Option(help="Exit once nothing is queued that fits")] = False,
) -> None:
    """Run a worker alone: it claims jobs that fit this host's GPUs and runs them."""
    settings = _settings()
    _usable_storage(settings, folders=True)
    models = _usable_models(settings)
    try:
        with database(settings, upgrade=True) as ready:
            ended = asyncio.run(_run_worker(ready, models, burst=burst))
    except errors.AppError as exc:
        raise _fail(exc) from exc
    if ended == "now":  # said in the log: what it killed, and which jobs it left
        raise typer.Exit(1)
    if ended == "failed" or (ended == "by itself" and not burst):
        # Only a failure (logged above: a side task died, or the worker raised) ends a worker nobody
        # asked to stop; exit non-zero, so a supervisor that restarts on failure starts it again.
        typer.echo("error: the worker stopped after an error (see the log above)", err=True)
        raise typer.Exit(1)


async def _run_worker(
    settings: Settings, models: Registry, *, burst: bool
) -> Literal["asked", "now", "by itself", "failed"]:
    """Run a worker until it stops: asked to (SIGTERM, SIGINT), asked again (stopped at once), by
    itself (burst mode's end, or a side task that died), or failed (it raised, logged here). A
    worker that cannot start raises."""
    from app import db, storage
    from app.queue.factory import build_worker
    from app.queue.manager import JobManager

    url = settings.database_url or ""
    await _check_schema(url)
    engine, queue_engine = db.create_engine(url), db.create_queue_engine(url)
    stopped_now = False
    try:
        w = build_worker(
            settings,
            manager=JobManager(engine, queue_engine=queue_engine, quarantine_after=settings.quarantine_after),
            store=storage.ResultStore(settings.storage_dir),
            models=models,
            listen_dsn=db.asyncpg_dsn(url),
            burst=burst,
        )
        asked = _stop_on_signals(w, settings.shutdown_grace_s)
        await w.start()
        try:
            await w.run()
        except Exception:  # said in the log, in its format, as serve's worker's is (not as a traceback)
            log.exception("the worker stopped after an error", extra={"action": "worker_ended"})
            return "failed"
        finally:
            stopped_now = w.stopped_now
        return "now" if stopped_now else "asked" if asked else "by itself"
    finally:
        # Stopped at once, the connections are let go of however the database answers their close.
        for pool in (queue_engine, engine):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.dispose(), timeout=DISPOSE_NOW_S if stopped_now else None)


def _stop_on_signals(w: Worker, grace_s: float) -> list[float]:
    """Have SIGTERM and SIGINT stop the worker gracefully, and a second one (REPEAT_S or more after
    the first: sooner, it is the first delivered twice) stop it at once; when each was asked."""
    from app import apiserver

    asked: list[float] = []

    def stop(sig: signal.Signals) -> None:
        now = time.monotonic()
        if not asked:
            log.info(
                "%s: stopping; running jobs have %g s to finish (again: stop at once)", sig.name, grace_s
            )
            w.stop()
        elif now - asked[0] >= apiserver.REPEAT_S:
            w.stop_now()
        asked.append(now)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    return asked


@cli.command(name="migrate")
def migrate_command() -> None:
    """Upgrade the database schema to the newest revision."""
    from app import migrate

    settings = _settings()
    try:
        with database(settings) as ready:  # migrated here, embedded or not
            at = migrate.upgrade(ready.database_url or "")
    except errors.AppError as exc:
        raise _fail(exc) from exc
    ahead = f" (ahead of this code's {migrate.head()}, which runs on it)" if at != migrate.head() else ""
    typer.echo(f"database at revision {at}{ahead}")


@cli.command(name="check")
def check_command(
    hash_: Annotated[
        bool, typer.Option("--hash", help="Also compare each file's SHA-256 (reads every result whole)")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Check that every kept result is on disk as stored (exit 1 if not); changes nothing."""
    from app import check, db

    settings = _settings()

    async def checked(url: str, root: Path) -> check.Report:
        await _check_schema(url)
        engine = db.create_engine(url, pool_size=1)
        try:
            return await check.run(engine, root, hash_=hash_)
        finally:
            await engine.dispose()

    try:
        root = check.results_root(settings.storage_dir)  # before an embedded database is made there
        with database(settings) as ready:
            report = asyncio.run(checked(ready.database_url or "", root))
    except errors.AppError as exc:
        raise _fail(exc) from exc
    typer.echo(report.as_json() if as_json else "\n".join(report.lines()))
    raise typer.Exit(0 if report.clean else 1)


@cli.command()
def models(as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False) -> None:
    """List the registered models and their parameters."""
    settings = _settings()
    try:
        found = modelsfile.load_registry(settings.models_file)
    except errors.AppError as exc:
        raise _fail(exc) from exc
    if as_json:
        typer.echo(json.dumps([m.public() for m in found.models.values()], indent=2, default=str))
        return
    for spec in found.models.values():
        typer.echo(f"{spec.name}: {spec.description}")
        vram = f"{spec.base_mb} MB + {spec.mb_per_megapixel:g} MB/megapixel"
        typer.echo(f"  vram: {vram}; timeout {spec.timeout_s:g} s; attempts {spec.max_attempts}")
        for p in spec.params.values():
            bounds = f" choices {'|'.join(_as_param(c) for c in p.choices)}" if p.choices else ""
            if p.min is not None or p.max is not None:
                bounds = f" range {p.min}..{p.max}"
            default = "(required)" if p.default is None else f"default {_as_param(p.default)}"
            typer.echo(f"  --param {p.name}=<{p.type}> {default}{bounds}  {p.description}")


def _as_param(value: object) -> str:
    """A value as `submit --param name=VALUE` takes it: JSON, but text as itself unless it would
    read as JSON (`false`, `80`)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value)


def main() -> None:
    """Entry point of the `gpujobs` script."""
    cli()
