"""When an enqueue counts the jobs waiting for the queue limit (app.queue.waiting.WaitingCount)."""

from __future__ import annotations

import pytest

from app.queue import waiting as waiting_


def test_the_jobs_waiting_are_counted_near_the_limit_and_at_least_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr(waiting_.time, "monotonic", lambda: clock[0])
    waiting = waiting_.WaitingCount()
    assert waiting.must_count(10_000) and waiting.known is None  # nothing known yet
    waiting.counted(5_000)
    assert not waiting.must_count(10_000)  # far from the limit, counted just now
    for _ in range(3_999):
        waiting.added()
    assert not waiting.must_count(10_000) and waiting.known == 8_999
    waiting.added()
    assert waiting.must_count(10_000)  # 9,000: in the limit's last tenth every enqueue counts
    waiting.counted(10)
    assert not waiting.must_count(10_000)
    clock[0] += 1.01
    assert waiting.must_count(10_000)  # the count is over a second old
    waiting.counted(0)
    assert waiting.must_count(2) and waiting.must_count(100)  # a small limit: always counted
    assert not waiting.must_count(101)
