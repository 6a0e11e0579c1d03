"""A link to the test database that a test can cut and mend: a real network outage for one
process's connections (refused and dropped), while the rest of the test reaches the server."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from sqlalchemy.engine import make_url


class CuttableLink:
    """Relays PostgreSQL connections from a unix socket in `folder` to the server of `url`."""

    def __init__(self, url: str, folder: Path) -> None:
        self._target = make_url(url)
        self._folder = folder
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.is_cut = False
        self._flowing = asyncio.Event()  # cleared by `stall`: bytes stop in both directions
        self._flowing.set()

    async def start(self) -> str:
        """Listen; the URL that reaches the server through this link."""
        self._folder.mkdir(parents=True, exist_ok=True)
        path = self._folder / ".s.PGSQL.5432"  # where libpq and asyncpg look, at the default port
        self._server = await asyncio.start_unix_server(self._relay, path=str(path))
        query = {k: v for k, v in self._target.query.items() if k not in ("host", "port")}
        linked = self._target.set(host=None, port=None, query={**query, "host": str(self._folder)})
        return linked.render_as_string(hide_password=False)

    def cut(self) -> None:
        """Drop every relayed connection and refuse new ones until `mend`."""
        self.is_cut = True
        for writer in self._open:
            writer.transport.abort()
        self._open.clear()

    def mend(self) -> None:
        self.is_cut = False
        self._flowing.set()

    def stall(self) -> None:
        """Keep every connection open and relay nothing more, either way (a host that vanished
        without a reset: a black hole), until `mend`."""
        self._flowing.clear()

    async def close(self) -> None:
        self.cut()
        self._flowing.set()  # the relays held by a stall see their transports gone, and end
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            writer.transport.abort()
            return
        socket_dir = self._target.query.get("host")
        if isinstance(socket_dir, str) and socket_dir.startswith("/"):
            port = self._target.port or 5432
            far = await asyncio.open_unix_connection(f"{socket_dir}/.s.PGSQL.{port}")
        else:
            far = await asyncio.open_connection(self._target.host or "127.0.0.1", self._target.port or 5432)
        self._open.update((writer, far[1]))
        await asyncio.gather(_pipe(reader, far[1], self._flowing), _pipe(far[0], writer, self._flowing))


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, flowing: asyncio.Event) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await source.read(65536):
            await flowing.wait()
            sink.write(data)
            await sink.drain()
    sink.transport.abort()
