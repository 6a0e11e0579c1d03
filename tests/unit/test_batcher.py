"""Batcher: concurrent writes coalesce, each caller gets its own answer or the write's error."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app import db
from app.queue.batcher import Batcher, CarrierCancelled


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


def recording() -> tuple[list[list[int]], Batcher[int, int]]:
    """A batcher whose own writes are recorded (answers: the items times 10)."""
    calls: list[list[int]] = []

    async def write_many(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        return [i * 10 for i in items]

    return calls, Batcher(write_many)


async def carry(items: Sequence[int]) -> tuple[list[int], str]:
    await asyncio.sleep(0)
    return [-i for i in items], f"carried {list(items)}"


async def alone() -> str:
    return "alone"


async def test_held_items_ride_the_next_statement_of_another_kind():
    calls, batcher = recording()
    batcher.hold(10.0)
    waiting = [asyncio.create_task(batcher.submit(i)) for i in (1, 2)]
    await asyncio.sleep(0.01)
    assert calls == [] and not any(t.done() for t in waiting)  # held: not written on their own
    assert await batcher.carried_by(carry, alone) == "carried [1, 2]"
    assert await asyncio.gather(*waiting) == [-1, -2]  # the carrier's answers
    assert (calls, batcher.statements, batcher.carried) == ([], 0, 2)
    assert await batcher.carried_by(carry, alone) == "alone"  # nothing waits now
    assert await batcher.submit(3) == 30  # the hold ended with the carrier: straight out


async def test_a_hold_runs_out_and_the_items_go_out_on_their_own():
    calls, batcher = recording()
    batcher.hold(0.02)
    waiting = asyncio.create_task(batcher.submit(1))
    await asyncio.sleep(0.005)
    assert not waiting.done()
    assert await asyncio.wait_for(waiting, 1) == 10
    assert calls == [[1]]


async def test_a_release_sends_the_held_items_at_once():
    calls, batcher = recording()
    batcher.hold(10.0)
    waiting = asyncio.create_task(batcher.submit(1))
    await asyncio.sleep(0)
    batcher.release()
    assert await asyncio.wait_for(waiting, 1) == 10
    assert calls == [[1]]


async def test_a_write_in_flight_leaves_items_that_arrive_under_a_hold_to_the_carrier():
    calls: list[list[int]] = []
    gate = asyncio.Event()

    async def write_many(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        await gate.wait()
        return list(items)

    batcher = Batcher(write_many)
    first = asyncio.create_task(batcher.submit(0))
    await asyncio.sleep(0.001)  # its write is in flight now
    batcher.hold(10.0)
    second = asyncio.create_task(batcher.submit(1))
    await asyncio.sleep(0)
    gate.set()
    assert await first == 0
    await asyncio.sleep(0.01)
    assert calls == [[0]] and not second.done()
    assert await batcher.carried_by(carry, alone) == "carried [1]"
    assert await second == -1


async def test_a_failed_carrier_fails_the_items_it_carried():
    _, batcher = recording()

    async def broken(items: Sequence[int]) -> tuple[list[int], str]:
        raise ConnectionError("database away")

    batcher.hold(10.0)
    waiting = asyncio.create_task(batcher.submit(1))
    await asyncio.sleep(0)
    with pytest.raises(ConnectionError):
        await batcher.carried_by(broken, alone)
    with pytest.raises(ConnectionError, match="database away"):
        await waiting


async def test_a_cancelled_carrier_leaves_its_items_an_unknown_outcome_to_check():
    """A cancel may land after the carrier committed: its items get a connection error (callers
    that ride out outages try again), not the cancel, which would drop their write unseen."""
    _, batcher = recording()
    started = asyncio.Event()

    async def slow(items: Sequence[int]) -> tuple[list[int], str]:
        started.set()
        await asyncio.sleep(10)
        return list(items), "late"

    batcher.hold(10.0)
    waiting = asyncio.create_task(batcher.submit(1))
    await asyncio.sleep(0)
    carrier = asyncio.create_task(batcher.carried_by(slow, alone))
    await started.wait()
    carrier.cancel()
    with pytest.raises(asyncio.CancelledError):
        await carrier
    with pytest.raises(CarrierCancelled):
        await waiting
    assert db.is_unavailable(CarrierCancelled("x"))
