"""Batcher: concurrent calls of one kind of write, made as one statement (group commit).

A caller adds its item and awaits its own answer. While no write is in flight, the item goes out
at the next turn of the event loop, with any others added in the same turn (no added latency when
the worker is quiet); items that arrive while a write is in flight wait for it to end and then go
out together, up to `max_items` per statement. Under load
the batches grow by themselves, and each job's write still gets its own answer or error.

A statement of another kind that is about to go out may carry the waiting items (`carried_by`):
a worker's claim carries the successes of the jobs whose slots it fills, one statement where
there were two. `hold(seconds)` keeps new items waiting for such a statement, for at most that
long; then they go out on their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Answer = TypeVar("Answer")
Result = TypeVar("Result")


UNKNOWN_OUTCOME = "the statement carrying this write was cancelled; its outcome is unknown"


class CarrierCancelled(ConnectionError):
    """The statement carrying an item was cancelled mid-way: whether the item was written is not
    known (a connection error, so callers that ride out outages try again and check)."""


class Batcher(Generic[Item, Answer]):
    """Coalesces `submit(item)` calls into `write_many(items) -> answers` (same order, same length)."""

    def __init__(
        self, write_many: Callable[[Sequence[Item]], Awaitable[Sequence[Answer]]], *, max_items: int = 64
    ) -> None:
        self._write_many = write_many
        self._max_items = max_items
        self._pending: list[tuple[Item, asyncio.Future[Answer]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._hold: asyncio.TimerHandle | None = None  # while set, waiting items stay for a carrier
        self.statements = 0  # how many statements were sent (tests, benchmarks)
        self.carried = 0  # how many items other statements carried

    async def submit(self, item: Item) -> Answer:
        """Write `item` with whatever else is waiting; its answer, or the write's exception."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._hold is None:
            self._start()
        return await future

    def hold(self, seconds: float) -> None:
        """Keep items waiting for `carried_by` for at most `seconds` from now (or until `release`)."""
        if self._hold is not None:
            self._hold.cancel()
        self._hold = asyncio.get_running_loop().call_later(seconds, self.release)

    def release(self) -> None:
        """End a hold: the waiting items go out on their own."""
        self._end_hold()
        if self._pending:
            self._start()

    async def carried_by(
        self,
        write_with: Callable[[Sequence[Item]], Awaitable[tuple[Sequence[Answer], Result]]],
        write_alone: Callable[[], Awaitable[Result]],
    ) -> Result:
        """Send a statement of another kind: `write_with(items)` carrying the items waiting now (its
        answers for them, and its own result), or `write_alone()` when none wait. Ends a hold.

        The carried items get their answers, or the statement's error; a cancel mid-way gives them
        CarrierCancelled (the statement may have committed)."""
        self._end_hold()
        if not self._pending:
            return await write_alone()
        taken = self._take()
        if self._pending:
            self._start()
        self.carried += len(taken)
        try:
            answers, result = await write_with([item for item, _ in taken])
        except BaseException as exc:
            _fail(taken, exc if isinstance(exc, Exception) else CarrierCancelled(UNKNOWN_OUTCOME))
            raise
        _answer(taken, answers)
        return result

    def _end_hold(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    def _take(self) -> list[tuple[Item, asyncio.Future[Answer]]]:
        """The waiting items of the next statement (at most `max_items`), taken off the queue."""
        batch, self._pending = self._pending[: self._max_items], self._pending[self._max_items :]
        return batch

    def _start(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain(), name="batcher")

    async def _drain(self) -> None:
        while self._pending and self._hold is None:
            batch = self._take()
            self.statements += 1
            try:
                answers = await self._write_many([item for item, _ in batch])
            except BaseException as exc:  # every caller of the batch gets it (and may retry)
                _fail(batch, exc)
                if isinstance(exc, asyncio.CancelledError):
                    for _, future in self._pending:
                        future.cancel()
                    self._pending = []
                    raise
                continue
            _answer(batch, answers)


def _answer(batch: Sequence[tuple[object, asyncio.Future[Answer]]], answers: Sequence[Answer]) -> None:
    """Each caller's answer (callers that gave up are skipped)."""
    for (_, future), answer in zip(batch, answers, strict=True):
        if not future.done():
            future.set_result(answer)


def _fail(batch: Sequence[tuple[object, asyncio.Future[Answer]]], error: BaseException) -> None:
    """The same error for every caller of a statement."""
    for _, future in batch:
        if not future.done():
            future.set_exception(error)
