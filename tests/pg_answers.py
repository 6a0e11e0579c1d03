"""Exit 0 if the PostgreSQL at the given URL accepts a connection within two seconds; else exit 1,
saying why on stderr when a server answered but refused (no such database, a password needed), so
that the second pass is not skipped in silence as if no server were there."""

from __future__ import annotations

import asyncio
import sys

import asyncpg


async def _answers(url: str) -> str | None:
    """None when the server takes the connection; else why not."""
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, TimeoutError) as exc:
        return f"no PostgreSQL there ({type(exc).__name__})"
    except asyncpg.PostgresError as exc:
        return f"a PostgreSQL answered but refused the connection: {exc}"
    await conn.close()
    return None


if __name__ == "__main__":
    why = asyncio.run(_answers(sys.argv[1]))
    if why is not None:
        print(f"{sys.argv[1]}: {why}", file=sys.stderr)
    sys.exit(0 if why is None else 1)
