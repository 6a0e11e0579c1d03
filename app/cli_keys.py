"""`gpujobs keys create|list|revoke`: the operator's side of API keys.

A new key is printed once, alone on stdout (so `KEY=$(gpujobs keys create alice)` works); only its
hash is stored. On a new installation, `gpujobs keys create admin --admin` makes the first admin key.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from app import errors, sigterm

if TYPE_CHECKING:
    from app import auth

# app.auth and app.db (SQLAlchemy) are imported when a keys command runs, not when `gpujobs` starts.

keys = typer.Typer(help="API keys: create, list and revoke.", no_args_is_help=True)
_T = TypeVar("_T")


def _with_store(action: Callable[[auth.KeyStore], Awaitable[_T]]) -> _T:
    """Run `action` on the configured database (the embedded one when no URL is set), at the code's
    schema: one behind it is not migrated here (a `serve` of an older checkout may be using it),
    and the command exits 2 saying to run `gpujobs migrate`. An embedded database never migrated
    (a new storage folder) is migrated first: no `serve` can be using it."""
    from app import auth, cli, db  # cli: the command module, which imports this one

    settings = cli._settings()

    async def run(url: str) -> _T:
        await cli._check_schema(url)  # a database never migrated: say so, not `no table api_keys`
        engine = db.create_engine(url, pool_size=1)
        try:
            return await action(auth.KeyStore(engine))
        finally:
            await engine.dispose()

    try:
        with cli.database(settings, upgrade=False) as ready:
            url = ready.database_url or ""
            if not settings.database_url:  # an external database: only by `gpujobs migrate`
                _migrate_if_new(url)
            return asyncio.run(run(url))
    except errors.AppError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from exc


def _migrate_if_new(url: str) -> None:
    """Migrate the database at `url` to the code's schema where it was never migrated (a first key
    made before `serve` or a `worker` ever ran on the folder); any other schema is left as it is."""
    from app import cli, migrate  # cli: the command module, which imports this one

    if asyncio.run(cli._schema_at(url)).at is None:
        migrate.upgrade(url)
        typer.echo(f"migrated the new embedded database to revision {migrate.head()}", err=True)


def _when(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M") if at is not None else "-"


@keys.command("create")
def create(
    name: Annotated[str, typer.Argument(help="The principal: who the key acts for and owns the jobs")],
    admin: Annotated[bool, typer.Option("--admin", help="May see and manage every job")] = False,
) -> None:
    """Make a new key for NAME and print it: it is shown only this once."""
    from app.auth import Role

    role = Role.admin if admin else Role.user
    made, held = _with_store(lambda store: _made_and_shown(store, name, role))
    typer.echo(
        f"created {made.info.role} key {made.info.id} ({made.info.prefix}...) for {made.info.principal!r}; "
        "it is shown only now: send it as `Authorization: Bearer <key>`",
        err=True,
    )
    if held is not None:
        raise typer.Exit(128 + held)  # interrupted while the key was stored: shown, then ended by it


async def _made_and_shown(store: auth.KeyStore, name: str, role: auth.Role) -> tuple[auth.NewKey, int | None]:
    """Store a key and print it, with Ctrl-C and SIGTERM held off in between: a key stored and not
    yet printed would be lost (stored, unseen, usable by no one). The key is printed at once, before
    the database closes. Returns the key and the signal held, if one came."""
    with sigterm.interrupts_held(
        "the key is being stored and will be printed once the database has it; Ctrl-C again gives up",
        "gave up; the key may be stored without having been shown: `gpujobs keys list` shows it, "
        "`gpujobs keys revoke ID` revokes it",
    ) as held:
        made = await store.create(name, role=role)
        typer.echo(made.secret)
    return made, held()


@keys.command("list")
def list_keys(
    include_revoked: Annotated[bool, typer.Option("--all", help="Also show revoked keys")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """List keys (never their secrets): id, prefix, principal, role, created, last used."""
    found = _with_store(lambda store: store.list_keys(include_revoked=include_revoked))
    if as_json:
        rows = [
            {
                "id": k.id,
                "prefix": k.prefix,
                "principal": k.principal,
                "role": k.role.value,
                "created_at": k.created_at.isoformat(),
                "last_used_at": k.last_used_at.isoformat() if k.last_used_at else None,
                "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
            }
            for k in found
        ]
        typer.echo(json.dumps(rows, indent=2))
        return
    # Times in UTC, as the database gives them; the header says so (two hosts' tables agree).
    times = f"{'created (UTC)':<16}  {'last used (UTC)':<16}"
    typer.echo(f"{'id':>5}  {'prefix':<12}  {'role':<5}  {times}  principal")
    for k in found:
        revoked = f"  (revoked {_when(k.revoked_at)})" if k.revoked_at else ""
        typer.echo(
            f"{k.id:>5}  {k.prefix:<12}  {k.role.value:<5}  {_when(k.created_at):<16}  "
            f"{_when(k.last_used_at):<16}  {k.principal}{revoked}"
        )


@keys.command("revoke")
def revoke(key: Annotated[str, typer.Argument(help="The key's id or prefix, as `keys list` shows")]) -> None:
    """Revoke a key: every request with it is refused (401) from now on."""
    info = _with_store(lambda store: store.revoke(key))
    typer.echo(f"revoked key {info.id} ({info.prefix}...) of {info.principal!r}")
