"""Inputs: the uploaded images, stored once per content, as the queue reads them back."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from app import errors


class Inputs:
    """Reads of stored images, over the manager's autocommit engine."""

    def __init__(self, auto: AsyncEngine) -> None:
        self._auto = auto

    async def by_id(self, input_id: int | None) -> tuple[str, bytes]:
        """An uploaded image by its id: (media type, bytes)."""
        if input_id is None:
            raise errors.Gone("the job's input image was deleted by retention")
        from app import tables  # late, as the note at app/queue/manager.py's imports says

        t = tables.Input
        async with self._auto.connect() as conn:
            row = (await conn.execute(select(t.media_type, t.data).where(t.id == input_id))).first()
        if row is None:  # retention deleted it after the job was read
            raise errors.Gone("the job's input image was deleted by retention")
        return str(row.media_type), bytes(row.data)

    async def sha256(self, input_id: int) -> str | None:
        """The SHA-256 of a stored image (images are stored once per digest); None if deleted."""
        from app import tables  # late, as the note at app/queue/manager.py's imports says

        t = tables.Input
        async with self._auto.connect() as conn:
            return await conn.scalar(select(t.sha256).where(t.id == input_id))
