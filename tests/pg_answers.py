"""Exit 0 if the PostgreSQL at the given URL accepts a connection within two seconds."""

from __future__ import annotations

import asyncio
import sys

import asyncpg


async def _answers(url: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


if __name__ == "__main__":
    sys.exit(0 if asyncio.run(_answers(sys.argv[1])) else 1)
