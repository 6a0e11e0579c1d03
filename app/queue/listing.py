"""Listing: the jobs, newest first, one page at a time behind an opaque cursor."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime

from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine

from app import errors
from app.queue import records
from app.queue.jobs import Job, JobState


def _cursor(job: Job) -> str:
    raw = f"{job.created_at.isoformat()}|{job.id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _parse_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, _, job_id = raw.partition("|")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None:
            raise ValueError("a cursor's time has its offset")
        # In UTC, as cursors are made: 0001-01-01 at +14:00 is a date PostgreSQL cannot hold.
        return when.astimezone(UTC), uuid.UUID(job_id)
    except (ValueError, OverflowError, UnicodeDecodeError) as exc:
        raise errors.InvalidRequest("cursor: not a cursor from a previous page", field="cursor") from exc


class Listing:
    """Pages of the job list, read over the manager's autocommit engine."""

    def __init__(self, auto: AsyncEngine) -> None:
        self._auto = auto

    async def page(
        self,
        *,
        owner: str | None = None,
        state: JobState | None = None,
        model: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> records.Page:
        """Jobs newest first, filtered, one page at a time."""
        from app import tables  # late, as the note at app/queue/manager.py's imports says

        t = tables.JobRow
        query = select(t.__table__).order_by(t.created_at.desc(), t.id.desc()).limit(limit + 1)
        if owner is not None:
            query = query.where(t.owner == owner)
        if state is not None:
            query = query.where(t.state == state)
        if model is not None:
            query = query.where(t.model == model)
        if cursor is not None:
            at, job_id = _parse_cursor(cursor)
            # A row comparison: the list's indexes (created_at DESC, id DESC) start at the cursor.
            # Spelt as `created_at < at OR (created_at = at AND id < job_id)` every older row was
            # read and sorted, however deep the page.
            query = query.where(tuple_(t.created_at, t.id) < tuple_(at, job_id))
        async with self._auto.connect() as conn:
            jobs = [Job.from_row(r) for r in (await conn.execute(query)).all()]
        more = len(jobs) > limit
        jobs = jobs[:limit]
        return records.Page(jobs, _cursor(jobs[-1]) if more else None)
