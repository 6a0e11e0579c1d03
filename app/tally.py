"""The tally of job life: counters and histograms built from job_events, each event counted once.

A new process's `JobTally` starts from the history up to a cut-off id, counted in groups by
PostgreSQL (`sql.EVENT_GROUPS_FOR_METRICS`), then counts the rows of `sql.EVENTS_FOR_METRICS` past it
in id order; its `Ledger` keeps which ids are counted across the holes that uncommitted or
rolled-back inserts leave in the ids. Both ways go through one `_count`, so they give the same
series. app/metrics.py reads the rows and serves the tally's families.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from app.queue.jobs import FINAL_STATES

JOB_BUCKETS_S: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)
# Each bound plus one ulp: the least value of the bucket after it (sql.EVENT_GROUPS_FOR_METRICS).
BUCKET_STARTS: Final = tuple(math.nextafter(b, math.inf) for b in JOB_BUCKETS_S)

FINAL: Final = frozenset(s.value for s in FINAL_STATES)
# Events after which a job waits in the queue, and events that end a running attempt.
QUEUE_ENTRY: Final = frozenset(
    {"submitted", "retry_scheduled", "recovered", "released", "retried", "out_of_memory"}
)
ATTEMPT_END: Final = frozenset({"retry_scheduled", "recovered", "released", "out_of_memory"}) | FINAL
# How long a hole in the event ids may stay open (a transaction not yet committed) before it is
# taken for a rolled-back insert and given up: counted ids past it wait no longer.
GAP_WAIT_S: Final = 10.0


def micros(seconds: float | Decimal) -> int:
    """Seconds (a float, or PostgreSQL's exact numeric) as whole microseconds, timestamps' unit."""
    return round(seconds * 1_000_000)


@dataclass(frozen=True, slots=True)
class Observed:
    """Observations in one bucket of a histogram: how many, and the sum of their values (µs)."""

    bucket: int
    count: int
    total_us: int

    @classmethod
    def grouped(cls, bucket: int | None, count: int, total: Any) -> Observed | None:
        """`count` values of one bucket summing to `total` seconds (None: nothing observed)."""
        return None if bucket is None else cls(bucket, count, micros(total))


@dataclass(slots=True)
class Buckets:
    """One histogram's cumulative state. Its sum is kept in whole microseconds: summed as floats,
    the history counted in SQL and the same events counted one by one differed in the last digits,
    and a new process could serve a sum lower than its predecessor had (a reset, to Prometheus)."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total_us: int = 0

    @property
    def total(self) -> float:
        """The sum of the observations, in seconds."""
        return self.total_us / 1_000_000

    def observe(self, value: float) -> None:
        """Count one observation."""
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total_us += micros(value)

    def add(self, observed: Observed) -> None:
        """Count observations of one bucket (of these bounds)."""
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[observed.bucket] += observed.count
        self.total_us += observed.total_us

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count of observations <= le) pairs, ending with +Inf."""
        counts = self.counts or [0] * (len(self.bounds) + 1)
        running, pairs = 0, []
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], counts, strict=True):
            running += count
            pairs.append((bound, float(running)))
        return pairs


class Ledger:
    """Which event ids are counted: all up to `floor`, then ranges above it with holes between.

    A hole is an id not (yet) read: an insert whose transaction has not committed, or one that
    rolled back (or a sequence's jump after a crash) and never will. Rows past a hole are counted
    at once; a hole is given up once a row past it was read GAP_WAIT_S ago, and all the holes seen
    by then are given up together, so a new process catches up over a long history in one wait.
    """

    def __init__(self, floor: int = 0) -> None:
        self.floor = floor  # every id up to here is counted or given up
        self._ranges: list[list[int]] = []  # counted [first, last] above the floor, in order
        self._reads: deque[tuple[float, int]] = deque()  # (when, highest id read then)
        self._read_long_ago = 0  # the highest id read at least GAP_WAIT_S ago

    def counted(self, event_id: int) -> bool:
        """Whether the id is counted (or given up)."""
        if event_id <= self.floor:
            return True
        i = bisect.bisect_right(self._ranges, event_id, key=lambda r: r[0])
        return i > 0 and self._ranges[i - 1][1] >= event_id

    def mark(self, event_id: int) -> None:
        """Record the id as counted (one not counted yet)."""
        ranges = self._ranges
        i = bisect.bisect_right(ranges, event_id, key=lambda r: r[0])
        if i > 0 and ranges[i - 1][1] + 1 == event_id:
            ranges[i - 1][1] = event_id
            if i < len(ranges) and ranges[i][0] == event_id + 1:  # the hole between them is filled
                ranges[i - 1][1] = ranges.pop(i)[1]
        elif i < len(ranges) and ranges[i][0] == event_id + 1:
            ranges[i][0] = event_id
        else:
            ranges.insert(i, [event_id, event_id])

    def advance(self, highest_read: int | None, now: float) -> None:
        """Move the floor past counted ids and past holes read around at least GAP_WAIT_S ago."""
        if highest_read is not None and (not self._reads or highest_read > self._reads[-1][1]):
            self._reads.append((now, highest_read))
        while self._reads and now - self._reads[0][0] >= GAP_WAIT_S:
            self._read_long_ago = max(self._read_long_ago, self._reads.popleft()[1])
        while self._ranges and (
            self._ranges[0][0] == self.floor + 1 or self._ranges[0][0] <= self._read_long_ago
        ):
            self.floor = self._ranges.pop(0)[1]

    def next_read(self, after: int) -> int:
        """Where to read on from `after`: at the next hole that may still fill, else past every id read."""
        holes = [self.floor + 1] if self._ranges else []
        holes += [r[1] + 1 for r in self._ranges[:-1]]
        later = [h for h in holes if h > after]
        return later[0] - 1 if later else max(after, self._ranges[-1][1] if self._ranges else self.floor)


class JobTally:
    """Counters and histograms of job life, built by reading job_events (each event once)."""

    def __init__(self, floor: int = 0) -> None:
        self.ids = Ledger(floor)
        self.submitted: Counter[str] = Counter()
        self.finished: Counter[tuple[str, str]] = Counter()
        self.attempts: Counter[str] = Counter()
        self.recoveries: Counter[str] = Counter()
        self.wait: dict[str, Buckets] = {}
        self.run: dict[str, Buckets] = {}
        self.end_to_end: dict[str, Buckets] = {}

    @property
    def floor(self) -> int:
        """Every event id up to here is counted (or was a hole given up)."""
        return self.ids.floor

    def add(self, rows: Sequence[Any], now: float) -> int:
        """Count the rows (ordered by id) not counted yet; returns how many."""
        counted = 0
        for row in rows:
            if not self.ids.counted(row.id):
                self._count(row, 1, row.since_prev_s, row.since_created_s)
                self.ids.mark(row.id)
                counted += 1
        self.ids.advance(rows[-1].id if rows else None, now)
        return counted

    @classmethod
    def from_groups(cls, groups: Iterable[Any], *, floor: int) -> JobTally:
        """A tally of every event up to id `floor`, from their groups (sql.EVENT_GROUPS_FOR_METRICS)."""
        tally = cls(floor)
        for g in groups:
            since_prev = Observed.grouped(g.prev_bucket, g.events, g.since_prev_s)
            since_created = Observed.grouped(g.created_bucket, g.events, g.since_created_s)
            tally._count(g, g.events, since_prev, since_created)
        return tally

    def _count(self, e: Any, times: int, since_prev: Any, since_created: Any) -> None:
        """Count `times` events alike: `e` has their model, kind, prev_kind and taken_back; the
        seconds since the previous event and since the job's creation are Observed (a group's)
        or one event's value (None: no previous event)."""
        model, kind = e.model, e.kind
        if kind == "submitted":
            self.submitted[model] += times
        elif kind == "claimed":
            self.attempts[model] += times
            if e.prev_kind in QUEUE_ENTRY and since_prev is not None:
                self._observe(self.wait, model, since_prev)
        if kind in ATTEMPT_END and e.prev_kind == "claimed" and since_prev is not None:
            self._observe(self.run, model, since_prev)
        if kind in FINAL:
            self.finished[(model, kind)] += times
            self._observe(self.end_to_end, model, since_created)
        if kind == "recovered" or (kind in FINAL and e.taken_back):
            self.recoveries[model] += times

    @staticmethod
    def _observe(histograms: dict[str, Buckets], model: str, seconds: Any) -> None:
        buckets = histograms.setdefault(model, Buckets(JOB_BUCKETS_S))
        if isinstance(seconds, Observed):
            buckets.add(seconds)
        else:
            buckets.observe(max(0.0, float(seconds)))

    def families(self) -> Iterable[Metric]:
        """The tally as Prometheus metric families."""
        yield _counter("gpujobs_jobs_submitted", "Jobs submitted", ["model"], self.submitted)
        finished = CounterMetricFamily(
            "gpujobs_jobs_finished", "Jobs that reached a final state", labels=["model", "state"]
        )
        for (model, state), count in sorted(self.finished.items()):
            finished.add_metric([model, state], count)
        yield finished
        yield _counter("gpujobs_job_attempts", "Attempts started (claims)", ["model"], self.attempts)
        yield _counter(
            "gpujobs_job_recoveries", "Jobs taken back from a lost worker", ["model"], self.recoveries
        )
        yield _histogram(
            "gpujobs_job_queue_wait_seconds", "Time queued before a claim (per attempt)", self.wait
        )
        yield _histogram("gpujobs_job_run_seconds", "Time from claim to the end of an attempt", self.run)
        yield _histogram(
            "gpujobs_job_end_to_end_seconds", "Time from submission to a final state", self.end_to_end
        )


def _counter(name: str, doc: str, labels: list[str], values: Counter[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, count in sorted(values.items()):
        family.add_metric([key], count)
    return family


def _histogram(name: str, doc: str, by_model: dict[str, Buckets]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model"])
    for model, buckets in sorted(by_model.items()):
        family.add_metric([model], buckets.cumulative(), sum_value=buckets.total)
    return family
