"""Batcher: concurrent calls of one kind of write, made as one statement (group commit).

A caller adds its item and awaits its own answer. While no write is in flight, the item goes out
at the next turn of the event loop, with any others added in the same turn (no added latency when
the worker is quiet); items that arrive while a write is in flight wait for it to end and then go
out together, up to `max_items` per statement. Under load
the batches grow by themselves, and each job's write still gets its own answer or error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class Batcher(Generic[Item, Answer]):
    """Coalesces `submit(item)` calls into `write_many(items) -> answers` (same order, same length)."""

    def __init__(
        self, write_many: Callable[[Sequence[Item]], Awaitable[Sequence[Answer]]], *, max_items: int = 64
    ) -> None:
        self._write_many = write_many
        self._max_items = max_items
        self._pending: list[tuple[Item, asyncio.Future[Answer]]] = []
        self._writer: asyncio.Task[None] | None = None
        self.statements = 0  # how many statements were sent (tests, benchmarks)

    async def submit(self, item: Item) -> Answer:
        """Write `item` with whatever else is waiting; its answer, or the write's exception."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain(), name="batcher")
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self._max_items], self._pending[self._max_items :]
            self.statements += 1
            try:
                answers = await self._write_many([item for item, _ in batch])
            except BaseException as exc:  # every caller of the batch gets it (and may retry)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    for _, future in self._pending:
                        future.cancel()
                    self._pending = []
                    raise
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                if not future.done():
                    future.set_result(answer)
