"""Prometheus metrics: job life, queue, workers and GPUs from the database; HTTP and streams per process.

Two kinds of series, so that numbers add up with any number of API and worker processes:

- **From the database** (every `gpujobs_job*`, `gpujobs_worker*`, `gpujobs_gpu*` series): read at
  scrape time, cached `cache_s`. Counters and histograms of job life are built by reading
  `job_events` in id order, incrementally (each process keeps its place), so they count what every
  process did, workers included, and every API process reports the same values. Queue depth and the
  worker / GPU gauges come from the `jobs` table and the workers' last heartbeat snapshots.
  Aggregate them across API processes with `max without (instance)`, not `sum`.
- **Measured by each process** (`gpujobs_http_*`, `gpujobs_stream_subscribers`, `process_*`,
  `python_*`). Without `PROMETHEUS_MULTIPROC_DIR`, each API process reports its own: Prometheus's
  `instance` label tells the processes apart; aggregate with `sum`.

  With `PROMETHEUS_MULTIPROC_DIR` set (by `gpujobs serve --processes N`, or an operator's own
  workers behind one port) the client's multiprocess mode sums them over the processes' files, so
  a scrape reaching any process reports the whole service: HTTP over every process that ever wrote
  there (an ended one's requests stay: a counter that fell would read as a reset), streams over the
  living (`mark_process_dead`). `process_*` and `python_gc_*` are left out (one process's numbers:
  wrong summed, and a different process at each scrape); `python_info` is the same everywhere.
  The folder must be empty when the processes start (old files would be counted again).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from app import db
from app.queue import manager as manager_
from app.queue import records
from app.queue.jobs import FINAL_STATES

log = logging.getLogger("gpujobs.metrics")

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
MB: Final = 1 << 20
JOB_BUCKETS_S: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)
HTTP_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

FINAL: Final = frozenset(s.value for s in FINAL_STATES)
UNFINISHED: Final = ("queued", "scheduled", "running")  # the states of the gpujobs_jobs gauge
# Events after which a job waits in the queue, and events that end a running attempt.
QUEUE_ENTRY: Final = frozenset(
    {"submitted", "retry_scheduled", "recovered", "released", "retried", "out_of_memory"}
)
ATTEMPT_END: Final = frozenset({"retry_scheduled", "recovered", "released", "out_of_memory"}) | FINAL
# How long a hole in the event ids may stay open (a transaction not yet committed) before it is
# taken for a rolled-back insert and given up: counted ids past it wait no longer.
GAP_WAIT_S: Final = 10.0
# The most a scrape waits on the database: well inside Prometheus's scrape timeout (10 s by
# default), so a database that takes connections and never answers reads as down, not as a
# failed scrape that loses every series (asyncpg alone waits 60 s for a connection).
READ_TIMEOUT_S: Final = 5.0
# How long a worker that died (not one that stopped) keeps its heartbeat age and job count in
# the series: as long as GET /admin/workers lists it.
DEAD_WORKERS_SHOWN_S: Final = 86_400.0


@dataclass(slots=True)
class Buckets:
    """One histogram's cumulative state."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, value: float) -> None:
        """Count one observation."""
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

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

    def __init__(self) -> None:
        self.floor = 0  # every id up to here is counted or given up
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

    def __init__(self) -> None:
        self.ids = Ledger()
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
                self._count(row)
                self.ids.mark(row.id)
                counted += 1
        self.ids.advance(rows[-1].id if rows else None, now)
        return counted

    def _count(self, row: Any) -> None:
        model, kind = row.model, row.kind
        if kind == "submitted":
            self.submitted[model] += 1
        elif kind == "claimed":
            self.attempts[model] += 1
            if row.prev_kind in QUEUE_ENTRY and row.since_prev_s is not None:
                self._observe(self.wait, model, row.since_prev_s)
        if kind in ATTEMPT_END and row.prev_kind == "claimed" and row.since_prev_s is not None:
            self._observe(self.run, model, row.since_prev_s)
        if kind in FINAL:
            self.finished[(model, kind)] += 1
            self._observe(self.end_to_end, model, row.since_created_s)
        if kind == "recovered" or (kind in FINAL and row.taken_back):
            self.recoveries[model] += 1

    @staticmethod
    def _observe(histograms: dict[str, Buckets], model: str, seconds: Any) -> None:
        histograms.setdefault(model, Buckets(JOB_BUCKETS_S)).observe(max(0.0, float(seconds)))

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


class DatabaseMetrics:
    """The series read from the database, refreshed at most every `cache_s` (a prometheus Collector)."""

    def __init__(
        self,
        manager: manager_.JobManager,
        *,
        cache_s: float,
        dead_after_s: float,
        models: Iterable[str] = (),
        batch: int = 5000,
    ) -> None:
        self._manager = manager
        self._models = sorted(models)  # registered: their queue gauges read 0, never nothing
        self._cache_s = cache_s
        self._dead_after_s = dead_after_s
        self._batch = batch
        self._lock = asyncio.Lock()
        self._refreshed_at: float | None = None
        self._up = 0
        self.tally = JobTally()
        self.caught_up = False  # the whole history read once: until then the tally is left out
        self._depth: list[tuple[str, str, int, int]] = []
        self._workers: list[records.WorkerInfo] = []

    async def refresh(self, *, budget_s: float = 2.0) -> None:
        """Read what changed since the last refresh, unless that was less than `cache_s` ago.

        A failed read counts as a refresh too: while the database is away, the scrapes within
        `cache_s` of one that waited on it answer at once (database_up 0) instead of each waiting
        up to READ_TIMEOUT_S again, one after another behind the lock."""
        async with self._lock:
            now = time.monotonic()
            if self._refreshed_at is not None and now - self._refreshed_at < self._cache_s:
                return
            try:
                async with asyncio.timeout(READ_TIMEOUT_S):
                    await self._tail(now + budget_s)
                    self._depth = await self._manager.queue_depth()
                    self._workers = await self._manager.workers(recent_s=DEAD_WORKERS_SHOWN_S)
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
                log.warning("metrics: database unavailable", extra={"action": "db_down"})
                self._up = 0
            else:
                self._up = 1
            self._refreshed_at = time.monotonic()

    async def _tail(self, deadline: float) -> None:
        """Count new events in batches (a new process catches up over a few scrapes, meanwhile
        leaving its job counters out: lower than the last process's, they would read as a reset)."""
        after = self.tally.floor
        while time.monotonic() < deadline:
            after = self.tally.ids.next_read(after)  # holes that may fill, then what is new
            rows = await self._manager.events_for_metrics(after=after, limit=self._batch)
            self.tally.add(rows, time.monotonic())
            if len(rows) < self._batch:
                self.caught_up = True
                return
            after = rows[-1].id

    def collect(self) -> Iterable[Metric]:
        """Every database-derived family, from the last refresh."""
        up = GaugeMetricFamily("gpujobs_metrics_database_up", "1 if the last read of the database worked")
        up.add_metric([], self._up)
        yield up
        if self.caught_up:  # a partial count would read as a counter reset, then a false rate
            yield from self.tally.families()
        depth = GaugeMetricFamily(
            "gpujobs_jobs", "Unfinished jobs by state and model", labels=["state", "model"]
        )
        totals: Counter[tuple[str, str]] = Counter(
            {(state, model): 0 for state in UNFINISHED for model in self._models}
        )
        for state, model, _priority, count in self._depth:
            totals[(state, model)] += count
        for (state, model), count in sorted(totals.items()):
            depth.add_metric([state, model], count)
        yield depth
        yield from worker_families(self._workers, dead_after_s=self._dead_after_s)


def worker_families(workers: Sequence[records.WorkerInfo], *, dead_after_s: float) -> Iterable[Metric]:
    """Per worker and GPU gauges from the workers' last heartbeat snapshots.

    A worker that stopped cleanly is left out. One that died (marked dead, or silent for
    `dead_after_s`) keeps its heartbeat age, which goes on growing for alerts to see, and its
    running jobs (none once they are taken back); its GPUs are left out, since the snapshot of a
    dead worker's reservations, jobs and runners is no longer true.
    """
    age = GaugeMetricFamily(
        "gpujobs_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat", labels=["worker"]
    )
    running = GaugeMetricFamily("gpujobs_worker_running_jobs", "Jobs the worker runs", labels=["worker"])
    names = ("total", "free", "reserved")
    memory = {
        n: GaugeMetricFamily(
            f"gpujobs_gpu_memory_{n}_bytes", f"GPU memory: {n}", labels=["worker", "gpu", "name"]
        )
        for n in names
    }
    gpu_jobs = GaugeMetricFamily(
        "gpujobs_gpu_running_jobs", "Jobs on the GPU", labels=["worker", "gpu", "name"]
    )
    warm = GaugeMetricFamily(
        "gpujobs_warm_runners",
        "Warm runners on the GPU, by model and state",
        labels=["worker", "gpu", "model", "state"],
    )
    starts = CounterMetricFamily(
        "gpujobs_warm_runner_starts",
        "Warm runners started on the GPU since its worker started, by model",
        labels=["worker", "gpu", "model"],
    )
    for w in workers:
        if w.state == "stopped":
            continue
        age.add_metric([w.id], w.heartbeat_age_s)
        running.add_metric([w.id], len(w.running_jobs))
        if w.state not in ("running", "stopping") or w.heartbeat_age_s >= dead_after_s:
            continue
        for g in w.gpus:
            index = str(g.get("index", "?"))
            labels = [w.id, index, str(g.get("name", ""))]
            for n in names:
                memory[n].add_metric(labels, int(g.get(f"{n}_mb") or 0) * MB)
            gpu_jobs.add_metric(labels, int(g.get("running_jobs") or 0))
            states = Counter((str(r.get("model")), str(r.get("state"))) for r in g.get("warm") or ())
            for (model, state), count in sorted(states.items()):
                warm.add_metric([w.id, index, model, state], count)
            for model, count in sorted((g.get("warm_starts") or {}).items()):
                starts.add_metric([w.id, index, model], int(count))
    yield from (age, running, *memory.values(), gpu_jobs, warm, starts)


MULTIPROC_DIR_VAR: Final = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The folder of the client's multiprocess mode; None when the mode is off (the variable unset)."""
    return os.environ.get(MULTIPROC_DIR_VAR)


def mark_process_dead(pid: int) -> None:
    """Drop an ended process's stream count from the sums; its HTTP counts stay. No-op without the mode."""
    path = multiprocess_dir()
    if path is not None:
        multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


@dataclass(frozen=True, slots=True)
class ProcessSeries:
    """The series a process measures itself: HTTP latency and open job streams."""

    http: Histogram
    streams: Gauge


def _process_series(registry: CollectorRegistry | None, *, streams_doc: str) -> ProcessSeries:
    http = Histogram(
        "gpujobs_http_request_duration_seconds",
        "Time to answer an HTTP request (until the response headers), by route and status",
        ["method", "route", "status"],
        buckets=HTTP_BUCKETS_S,
        registry=registry,
    )
    streams = Gauge("gpujobs_stream_subscribers", streams_doc, multiprocess_mode="livesum", registry=registry)
    return ProcessSeries(http, streams)


@functools.cache
def _shared_process_series() -> ProcessSeries:
    """Multiprocess mode: the process's one set, written to its files (several sets would overwrite
    each other's values there); read back, with every other process's, by the MultiProcessCollector."""
    if values.ValueClass is values.MutexValue:
        raise RuntimeError(f"{MULTIPROC_DIR_VAR} was set after prometheus_client was imported, not before")
    series = _process_series(None, streams_doc="Open job streams in the service's living processes")
    series.streams.set(0)  # a file left by a dead process of the same pid must not count its streams
    return series


class Metrics:
    """One API process's registry: database series, HTTP latency, stream count, process stats."""

    def __init__(
        self,
        manager: manager_.JobManager,
        *,
        cache_s: float,
        dead_after_s: float,
        models: Iterable[str] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        self.database = DatabaseMetrics(manager, cache_s=cache_s, dead_after_s=dead_after_s, models=models)
        self.registry.register(self.database)
        path = multiprocess_dir()
        if path is None:
            series = _process_series(self.registry, streams_doc="Open job streams in this process")
            for collector in (ProcessCollector, PlatformCollector, GCCollector):
                collector(registry=self.registry)
        else:
            series = _shared_process_series()
            multiprocess.MultiProcessCollector(self.registry, path)  # type: ignore[no-untyped-call]
            PlatformCollector(registry=self.registry)  # python_info: the same in every process
        self.http, self.streams = series.http, series.streams

    async def render(self) -> bytes:
        """The exposition text, after refreshing the database series if they are stale."""
        await self.database.refresh()
        return generate_latest(self.registry)
