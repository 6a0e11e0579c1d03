"""ProgressFeed: a model's progress reaches the callback at most four times a second, the newest
update winning, and the run's last update is delivered at its end at once."""

from __future__ import annotations

import asyncio
import time

from app import progress


class Recorder:
    """A progress callback that records what reached it, taking `delay_s` per update (a write)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.seen: list[tuple[float, str]] = []

    async def __call__(self, fraction: float, message: str) -> None:
        await asyncio.sleep(self.delay_s)
        self.seen.append((fraction, message))


async def test_a_drain_after_a_flood_to_a_slow_callback_makes_one_write_at_most() -> None:
    """Before, the feed queued up to 1,000 updates and the drain at a run's end delivered them one
    by one for up to 5 s (a database round trip each) while the job kept its GPU slot; now it keeps
    only the newest, so the drain waits for the write under way and makes one more."""
    callback = Recorder(delay_s=0.02)
    feed = progress.ProgressFeed(callback, "test-progress")
    feed.put(0.0, "first")
    await asyncio.sleep(0.005)  # its write is under way
    for n in range(1, 1000):
        feed.put(1.0, f"update {n}")
    started = time.monotonic()
    await feed.drain()
    assert time.monotonic() - started < 0.5
    assert callback.seen == [(0.0, "first"), (1.0, "update 999")]


async def test_updates_closer_than_the_interval_are_coalesced_into_the_newest() -> None:
    """Before, every update reached the callback (and each of the attempt's exempt values, 1.0
    among them, became a database write and a NOTIFY); now the first goes at once and the newest of
    those that follow goes when the interval is over: the ones in between are never delivered."""
    callback = Recorder()
    feed = progress.ProgressFeed(callback, "test-progress")
    feed.put(1.0, "a")
    await asyncio.sleep(0.01)
    feed.put(1.0, "b")
    feed.put(1.0, "c")
    await asyncio.sleep(0.1)
    assert callback.seen == [(1.0, "a")]  # within the interval: held back
    await asyncio.sleep(progress.PROGRESS_INTERVAL_S)
    assert callback.seen == [(1.0, "a"), (1.0, "c")]
    feed.put(0.5, "d")
    feed.put(0.6, "e")  # the run's last update: the drain delivers it without waiting out the interval
    started = time.monotonic()
    await feed.drain()
    assert time.monotonic() - started < 0.1
    assert callback.seen == [(1.0, "a"), (1.0, "c"), (0.6, "e")]
