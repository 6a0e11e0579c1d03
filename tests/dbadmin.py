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


async def up_for_s(server_url: str) -> float:
    """How long the server at `server_url` has been running since its last start."""
    conn = await asyncpg.connect(db.asyncpg_dsn(server_url))
    try:
        return float(await conn.fetchval("SELECT extract(epoch FROM now() - pg_postmaster_start_time())"))
    finally:
        await conn.close()
