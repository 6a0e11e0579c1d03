"""Query plans for the tests: what PostgreSQL did to run a statement, as JSON plan nodes."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import text
from sqlalchemy.util import greenlet_spawn

from app import db

# Finished jobs beside the test's own: copies of every job in the table, succeeded, with a peak
# recorded (as a GPU host records one for each run).
FINISHED_BESIDE = text(
    """
    INSERT INTO jobs (owner, model, input_id, megapixels, priority, vram_mb, declared_vram_mb,
                      max_attempts, attempt, state, vram_peak_mb, created_at, run_after, started_at,
                      finished_at)
    SELECT owner, model, input_id, megapixels, 0, vram_mb, vram_mb, 1, 1, 'succeeded', vram_mb,
           now() - (g + 2) * interval '1 second', now() - (g + 2) * interval '1 second',
           now() - (g + 1) * interval '1 second', now() - g * interval '1 second'
    FROM jobs, generate_series(1, :count) AS g
    """
)

# Queued jobs beside the test's own: copies of every job in the table, created now.
QUEUED_BESIDE = text(
    """
    INSERT INTO jobs (owner, model, input_id, megapixels, vram_mb, declared_vram_mb, max_attempts)
    SELECT owner, model, input_id, megapixels, vram_mb, vram_mb, 3
    FROM jobs, generate_series(1, :count)
    """
)

# Stored images beside the test's own (one-byte stand-ins), as a service keeps them for its jobs.
INPUTS_BESIDE = text(
    """
    INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
    SELECT md5(g::text), 'image/png', 1, 1, 1, '\\x00'::bytea FROM generate_series(1, :count) AS g
    """
)


def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A JSON plan node and every node below it."""
    return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]


def scans_of(plan: dict[str, Any], table: str) -> set[str]:
    """The kinds of node that read `table` (Seq Scan, Index Scan, ModifyTable...)."""
    return {n["Node Type"] for n in nodes(plan) if n.get("Relation Name") == table}


def rows_read(plan: dict[str, Any], table: str) -> float:
    """Rows the plan's scans of `table` returned or filtered out (per loop times loops)."""
    scans = [n for n in nodes(plan) if n.get("Relation Name") == table and n["Node Type"] != "ModifyTable"]
    return sum((n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"] for n in scans)


async def explained(engine: Any, statement: Any, values: Any) -> dict[str, Any]:
    """The plan of `statement` run with `values` (EXPLAIN ANALYZE, rolled back)."""
    async with engine.connect() as conn:
        plan = await conn.scalar(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement.text}"), values)
        await conn.rollback()
    return plan[0]["Plan"]


async def prepared_plans(engine: Any, statement: Any, values: Any, plan_cache_mode: str) -> list[Any]:
    """Run `statement` as `db.fetch_rows` does (a prepared statement on a pooled driver connection)
    with `plan_cache_mode`, inside a transaction rolled back, and return the plans auto_explain
    reported for it: a generic plan (`force_generic_plan`) is what a prepared statement may
    switch to after a few runs, and EXPLAIN with values never shows it."""
    return [report["Plan"] for report in await prepared_reports(engine, statement, values, plan_cache_mode)]


async def prepared_reports(engine: Any, statement: Any, values: Any, plan_cache_mode: str) -> list[Any]:
    """As `prepared_plans`, but auto_explain's whole reports: the plan, and beside it "JIT" when
    the statement was JIT-compiled."""
    compiled = db._driver_sql(statement, engine.dialect)
    notices: list[str] = []
    pooled = await engine.raw_connection()
    driver = pooled.driver_connection
    driver.add_log_listener(lambda _conn, message: notices.append(message.message))
    transaction = driver.transaction()
    await transaction.start()
    try:
        await driver.execute(f"{auto_explain('LOCAL')}; SET LOCAL plan_cache_mode = {plan_cache_mode}")
        await driver.fetch(compiled.string, *(values[k] for k in compiled.names))
    finally:
        await transaction.rollback()
        await greenlet_spawn(pooled.invalidate)  # auto_explain stays loaded in that session
    return [r for r in explain_reports(notices) if r["Query Text"] == compiled.string]


def auto_explain(scope: str = "SESSION") -> str:
    """SQL that makes auto_explain report every statement's plan, run and timed, as a JSON notice
    (`scope`: SESSION, or LOCAL for the transaction); `explain_reports` reads the notices."""
    settings = ("log_min_duration = 0", "log_analyze = on", "log_format = json", "log_level = notice")
    return "; ".join(["LOAD 'auto_explain'", *(f"SET {scope} auto_explain.{s}" for s in settings)])


def explain_reports(notices: list[str]) -> list[Any]:
    """auto_explain's reports among a connection's notices (each with its "Query Text" and "Plan")."""
    return [json.loads(n[n.index("{") :]) for n in notices if "Query Text" in n]
