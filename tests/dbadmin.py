"""Server-level statements (CREATE / DROP DATABASE, CHECKPOINT) for the tests and the benchmarks."""

from __future__ import annotations

import asyncpg

from app import db


async def admin(server_url: str, *statements: str) -> None:
    """Run `statements` outside any transaction on the server at `server_url`."""
    conn = await asyncpg.connect(db.asyncpg_dsn(server_url))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()
