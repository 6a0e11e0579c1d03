"""`gpujobs serve`: the HTTP API in one process, or in several that share one port.

One process is the default (app/apiserver.py). An upload costs the API several milliseconds of CPU
(the multipart form, the image check, the hash, the send of the megabyte), and one Python process
uses one core, so on a host with cores to spare one process is the bound on uploads long before
PostgreSQL is (tests/bench/README.md). With `GPUJOBS_API_PROCESSES` = N > 1 a parent binds the port
once and keeps N children serving it (app/supervisor.py).
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

from app import apiserver, errors, supervisor

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger("gpujobs.serve")


def listen(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A socket listening on host:port, for uvicorn to serve; ConfigError naming the settings if
    the address cannot be had (in use, or no address of this host).

    Bound before the app starts: uvicorn given only host and port runs the app's start-up, which
    starts the in-process worker, before it binds, so a port in use was found after the worker had
    claimed jobs. Listening at once also keeps the port from a second `serve` starting beside
    this one (two sockets with SO_REUSEADDR may both bind a port that none listens on yet)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    # IPPROTO_TCP by name: asyncio turns Nagle off (TCP_NODELAY) only on the connections of such a
    # socket. Made with protocol 0, every answer's body (written after its head) waited for the
    # client's delayed ACK: 40 ms on most requests of a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise errors.ConfigError(
            f"GPUJOBS_HOST/GPUJOBS_PORT (--host/--port): cannot listen on {where}: {exc}"
        ) from exc
    return sock


def run(settings: Settings, processes: int, sock: socket.socket) -> int:
    """Serve on `sock` (listening) in this process, or in `processes` of them; the exit code."""
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if sock.family == socket.AF_INET6 else host, port)
    if processes == 1:
        return apiserver.serve_app(settings, sock)
    return supervisor.serve_processes(settings, processes, sock)
