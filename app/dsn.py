"""Database URLs (DSNs) as the settings take them: checked for what asyncpg can use, given its driver.

A URL is checked when the settings are read, so a bad one is named there (its variable, what to
fix), not at the first connection. Nothing here connects, and the client commands import it with
the settings: SQLAlchemy's URL parser is imported only when a URL is checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

# What a database URL's query may hold: what SQLAlchemy's asyncpg dialect hands asyncpg.connect()
# as keyword arguments (any other is a TypeError at the first connection), and what asyncpg's own
# URL parser (LISTEN's connection) reads, where an unknown name is sent to the server as a setting.
URL_QUERY = (
    "host", "port", "user", "password", "database", "passfile", "ssl", "sslmode", "target_session_attrs",
)  # fmt: skip
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def asyncpg_url(value: str) -> str:
    """`value` as a postgresql+asyncpg:// URL (libpq's sslmode as asyncpg's ssl); a ValueError
    saying what to fix when asyncpg could not use it (the URL is not repeated: it may hold a password)."""
    from sqlalchemy import exc
    from sqlalchemy.engine import make_url

    scheme, sep, _ = value.partition("://")
    if not sep or scheme not in {"postgres", "postgresql", "postgresql+asyncpg"}:
        raise ValueError("must be a postgresql:// URL")
    try:
        url = make_url(value)
    except (ValueError, exc.ArgumentError):
        raise ValueError(
            "cannot be read as a URL such as postgresql://user:password@host:5432/database (the port "
            "a number, an IPv6 address in brackets: [::1])"
        ) from None
    if url.host is not None and "@" in url.host:  # a password's @ ended it: its tail read as the host
        raise ValueError(
            "has an @ in its user or password: write it there as %40 (postgresql://user:p%40ss@host/db)"
        )
    url = _socket_host_in_query(url)
    _check_query(url.query)
    ports = str(url.query.get("port", "")).split(",") + ([str(url.port)] if url.port is not None else [])
    for port in ports:
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"port {port} is not a number between 1 and 65535")
    return url.set(drivername="postgresql+asyncpg", query=_ssl_query(dict(url.query))).render_as_string(
        hide_password=False
    )


def _socket_host_in_query(url: URL) -> URL:
    """libpq's percent-encoded socket folder as the host (postgresql://%2Fvar%2Frun%2Fpostgresql/db)
    moved to the query's host, where asyncpg looks for it: as the host, asyncpg looked the text up
    as a host name and failed at the first connection."""
    from urllib.parse import unquote

    if url.host is None or not (folder := unquote(url.host)).startswith("/"):
        return url
    if "host" in url.query:
        raise ValueError("names a socket folder as its host and a host in its query: give one of them")
    if "port" in url.query and url.port is not None:
        raise ValueError("gives a port after its host and in its query: give one of them")
    moved = {"host": folder} | ({"port": str(url.port)} if url.port is not None else {})
    return url._replace(host=None, port=None).update_query_dict(moved)


def _check_query(query: Mapping[str, str | tuple[str, ...]]) -> None:
    """A ValueError for a query parameter asyncpg does not take, or one given twice (but host:
    SQLAlchemy reads host=h1:p1&host=h2:p2 as several hosts)."""
    for name, value in query.items():
        if name not in URL_QUERY:
            raise ValueError(f"asyncpg takes no {name!r} in the URL's query; it takes {', '.join(URL_QUERY)}")
        if not isinstance(value, str) and name != "host":
            raise ValueError(f"{name} is given twice in the URL's query")


def _ssl_query(query: dict[str, str | tuple[str, ...]]) -> dict[str, str | tuple[str, ...]]:
    """The query with libpq's `sslmode` renamed `ssl`, asyncpg's keyword (the same modes)."""
    if "ssl" in query and "sslmode" in query:
        raise ValueError("give ssl or sslmode in the URL's query, not both")
    name = "sslmode" if "sslmode" in query else "ssl"
    if name in query and query[name] not in SSL_MODES:
        raise ValueError(f"{name} {query[name]!r} is not one of {', '.join(SSL_MODES)}")
    if "sslmode" in query:
        query["ssl"] = query.pop("sslmode")
    return query
