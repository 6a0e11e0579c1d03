"""Batcher: concurrent writes coalesce, each caller gets its own answer or the write's error."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.queue.batcher import Batcher


async def test_writes_submitted_meanwhile_go_out_together():
    calls: list[list[int]] = []

    async def write_many(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        await asyncio.sleep(0.01)
        return [i * 10 for i in items]

    batcher = Batcher(write_many, max_items=4)
    answers = await asyncio.gather(*(batcher.submit(i) for i in range(7)))
    assert answers == [i * 10 for i in range(7)]
    assert calls == [[0, 1, 2, 3], [4, 5, 6]]  # submitted in one turn of the loop: no wait
    assert batcher.statements == 2
    late = asyncio.create_task(batcher.submit(7))
    await asyncio.sleep(0.001)  # its write is in flight now
    assert await asyncio.gather(late, batcher.submit(8), batcher.submit(9)) == [70, 80, 90]
    assert calls[-2:] == [[7], [8, 9]]
    assert await batcher.submit(1) == 10  # quiet again: straight out


async def test_a_failed_write_fails_its_callers_only():
    async def write_many(items: Sequence[int]) -> list[int]:
        await asyncio.sleep(0)
        if 1 in items:
            raise ConnectionError("database away")
        return list(items)

    batcher = Batcher(write_many)
    first = asyncio.create_task(batcher.submit(0))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(batcher.submit(i)) for i in (1, 2)]
    assert await first == 0
    for task in rest:
        with pytest.raises(ConnectionError):
            await task
    assert await batcher.submit(3) == 3
