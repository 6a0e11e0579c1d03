"""JobTally: counters and histograms of job life from job_events, in id order, across id holes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.tally import GAP_WAIT_S, JobTally


def event(
    id: int, kind: str, *, prev: str | None = None, since_prev: float | None = None, **more: Any
) -> SimpleNamespace:
    """A row as sql.EVENTS_FOR_METRICS returns it."""
    values = {"model": "m", "taken_back": False, "since_created_s": 0.0, **more}
    return SimpleNamespace(id=id, kind=kind, prev_kind=prev, since_prev_s=since_prev, **values)


def life() -> list[SimpleNamespace]:
    """Submitted, claimed, failed and scheduled, claimed again, succeeded; plus noise events."""
    return [
        event(1, "submitted"),
        event(2, "claimed", prev="submitted", since_prev=2.0),
        event(3, "started"),
        event(4, "progress"),
        event(5, "retry_scheduled", prev="claimed", since_prev=3.0),
        event(6, "claimed", prev="retry_scheduled", since_prev=0.5),
        event(7, "succeeded", prev="claimed", since_prev=4.0, since_created_s=9.5),
    ]


def samples(tally: JobTally) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The tally rendered and parsed back, as Prometheus would read it."""

    class Source:
        def collect(self) -> Any:
            return tally.families()

    registry = CollectorRegistry()
    registry.register(Source())
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_one_job_with_a_retry():
    tally = JobTally()
    assert tally.add(life(), now=0.0) == 7
    found = samples(tally)
    m = frozenset({("model", "m")})
    assert found[("gpujobs_jobs_submitted_total", m)] == 1
    assert found[("gpujobs_job_attempts_total", m)] == 2
    assert found[("gpujobs_jobs_finished_total", m | {("state", "succeeded")})] == 1
    assert found[("gpujobs_job_queue_wait_seconds_count", m)] == 2
    assert found[("gpujobs_job_queue_wait_seconds_sum", m)] == 2.5
    assert found[("gpujobs_job_run_seconds_count", m)] == 2  # both attempts, the failed one too
    assert found[("gpujobs_job_run_seconds_sum", m)] == 7.0
    assert found[("gpujobs_job_run_seconds_bucket", m | {("le", "2.5")})] == 0
    assert found[("gpujobs_job_run_seconds_bucket", m | {("le", "5.0")})] == 2
    assert found[("gpujobs_job_end_to_end_seconds_sum", m)] == 9.5


def test_a_hole_in_the_ids_waits_for_the_late_commit():
    rows = life()
    tally = JobTally()
    assert tally.add([rows[0], rows[2]], now=100.0) == 2  # 2 is not committed yet: 3 counts anyway
    assert tally.floor == 1 and tally.ids.next_read(0) == 1  # the next read starts at the hole
    assert tally.add(rows[1:], now=101.0) == 5  # it came: everything is counted once
    assert tally.floor == 7 and tally.ids.next_read(1) == 7
    assert tally.submitted["m"] == 1 and tally.attempts["m"] == 2


def test_a_hole_that_never_fills_is_given_up_after_a_while():
    rows = life()
    tally = JobTally()
    assert tally.add(rows[2:], now=100.0) == 5
    assert tally.add(rows[2:], now=100.0 + GAP_WAIT_S / 2) == 0
    assert tally.floor == 0
    assert tally.add([], now=100.0 + GAP_WAIT_S) == 0  # rolled back: move on
    assert tally.floor == 7
    assert tally.add(rows[:2], now=200.0) == 0  # too late: the floor has passed them
    assert tally.submitted["m"] == 0 and tally.attempts["m"] == 1


def test_every_hole_of_a_long_history_is_given_up_in_one_wait():
    """A new process read its history up to the first hole, waited 10 s, then up to the next hole:
    a history with a hole every few hundred events took hours to count."""
    tally = JobTally()
    rows = [event(i, "submitted") for i in range(1, 10_001) if i % 100 != 50]  # 100 holes
    assert tally.add(rows, now=0.0) == len(rows) == tally.submitted["m"]
    assert tally.floor == 49 and tally.ids.next_read(5000) == 5049
    tally.add([event(150, "claimed", prev="submitted", since_prev=1.0)], now=1.0)  # a late commit
    assert tally.attempts["m"] == 1 and tally.ids.next_read(140) == 249
    late = event(10_001, "submitted")
    assert tally.add([late], now=GAP_WAIT_S) == 1
    assert tally.floor == 10_001  # the holes seen 10 s ago: gone, all at once
    assert tally.ids.next_read(0) == 10_001
    assert tally.add([late, event(10_002, "submitted")], now=11.0) == 1 and tally.floor == 10_002


def test_recoveries_and_cancels_of_queued_jobs():
    tally = JobTally()
    rows = [
        event(1, "submitted"),
        event(2, "claimed", prev="submitted", since_prev=1.0),
        event(3, "recovered", prev="claimed", since_prev=20.0, taken_back=True),
        event(4, "canceled", prev="recovered", since_prev=2.0, since_created_s=23.0),
        event(5, "submitted", model="other"),
        event(6, "failed", prev="claimed", since_prev=1.0, taken_back=True, model="other"),
    ]
    tally.add(rows, now=0.0)
    assert tally.recoveries == {"m": 1, "other": 1}
    assert tally.finished == {("m", "canceled"): 1, ("other", "failed"): 1}
    assert tally.run["m"].counts[-1] == 0 and sum(tally.run["m"].counts) == 1  # canceled while queued
    assert sum(tally.end_to_end["m"].counts) == 1


def test_an_out_of_memory_requeue_ends_the_attempt_and_starts_a_new_wait():
    tally = JobTally()
    rows = [
        event(1, "submitted"),
        event(2, "claimed", prev="submitted", since_prev=1.0),
        event(3, "out_of_memory", prev="claimed", since_prev=5.0),
        event(4, "claimed", prev="out_of_memory", since_prev=0.5),
        event(5, "succeeded", prev="claimed", since_prev=6.0, since_created_s=12.5),
    ]
    assert tally.add(rows, now=0.0) == 5
    assert tally.run["m"].total == 11.0 and tally.wait["m"].total == 1.5
    assert tally.finished == {("m", "succeeded"): 1}
