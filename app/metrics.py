"""Prometheus metrics: job life, queue, workers and GPUs from the database; HTTP and streams per process.

Two kinds of series, so that numbers add up with any number of API and worker processes:

- **From the database** (every `gpujobs_job*`, `gpujobs_worker*`, `gpujobs_gpu*` series): read at
  scrape time, cached `cache_s`. Counters and histograms of job life are built from `job_events`:
  a new process has the database count the history up to a cut-off (app/tally.py), then reads on
  in id order, incrementally (each process keeps its place), so they count what every process
  did, workers included, and every API process reports the same values. Queue depth and the
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
import contextlib
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from app import db, retention, tally
from app.queue import manager as manager_
from app.queue import records

log = logging.getLogger("gpujobs.metrics")

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
MB: Final = 1 << 20
HTTP_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

UNFINISHED: Final = ("queued", "scheduled", "running")  # the states of the gpujobs_jobs gauge
# The most a scrape waits on the database: well inside Prometheus's scrape timeout (10 s by
# default), so a database that takes connections and never answers reads as down, not as a
# failed scrape that loses every series (asyncpg alone waits 60 s for a connection).
READ_TIMEOUT_S: Final = 5.0
# How long a worker that died (not one that stopped) keeps its heartbeat age and job count in
# the series: as long as GET /admin/workers lists it.
DEAD_WORKERS_SHOWN_S: Final = 86_400.0
# The most the count of the history in SQL may take (a new process's start of the job series, in a
# task of its own): 13 s beside 1,000,000 jobs on a 2-core VM. Past it, or on any failure, the
# next refresh starts it again. It is the count's statement_timeout too, whatever the server's.
HISTORY_TIMEOUT_S: Final = 600.0


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
        self.tally = tally.JobTally()
        self._counting: asyncio.Task[tally.JobTally] | None = None  # the history, counted in SQL
        self._started = False  # the tally has its start from that count
        self.caught_up = False  # the whole history read once: until then the tally is left out
        self._depth: list[tuple[str, str, int, int]] | None = None  # None: never read
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
                    if await self._start(now + budget_s):
                        await self._tail(now + budget_s)
                    self._depth = await self._manager.reports.queue_depth()
                    self._workers = await self._manager.reports.workers(recent_s=DEAD_WORKERS_SHOWN_S)
            except db.ERRORS as exc:  # an outage, or a statement the server cancelled: no 500
                self._read_failed(exc)
            else:
                self._up = 1
            self._refreshed_at = time.monotonic()

    def _read_failed(self, error: Exception) -> None:
        """database_up 0, the values read before kept; logged once while the reads fail."""
        if self._up or self._refreshed_at is None:  # not again at every scrape of an outage
            unavailable = db.is_unavailable(error)
            log.warning(
                "metrics: database unavailable" if unavailable else "metrics: reading the database failed",
                exc_info=not unavailable,
                extra={"action": "db_down"},
            )
        self._up = 0

    async def _start(self, deadline: float) -> bool:
        """Whether the tally has its start: the history up to a cut-off, counted by the database
        (`Reports.event_groups_for_metrics`), which the tail goes on from.

        The count runs in a task of its own: a refresh waits for it until `deadline`, then leaves
        it running for a later refresh to take (the job series left out until then), so a scrape
        waits no longer on a long history. A count that failed fails the refresh that takes it
        (`gpujobs_metrics_database_up` 0); the next starts another."""
        if self._started:
            return True
        if self._counting is None:
            self._counting = asyncio.create_task(self._count_history(), name="metrics-history")
        await asyncio.wait([self._counting], timeout=max(0.0, deadline - time.monotonic()))
        if not self._counting.done():
            return False
        counting, self._counting = self._counting, None
        if counting.cancelled():
            return False
        self.tally = counting.result()
        self._started = True
        return True

    async def _count_history(self) -> tally.JobTally:
        started = time.monotonic()
        async with asyncio.timeout(HISTORY_TIMEOUT_S):
            floor, groups = await self._manager.reports.event_groups_for_metrics(
                older_than_s=tally.GAP_WAIT_S,
                final=tally.FINAL,
                bucket_starts=tally.BUCKET_STARTS,
                timeout_s=HISTORY_TIMEOUT_S,
            )
        seconds = time.monotonic() - started
        log.info(
            "metrics: job history counted up to event %d in %.1f s",
            floor,
            seconds,
            extra={"action": "history_counted", "event_id": floor, "ms": round(seconds * 1000)},
        )
        return tally.JobTally.from_groups(groups, floor=floor)

    async def aclose(self) -> None:
        """Stop counting the history, if it still is (a process that ends before the count lands)."""
        if self._counting is not None:
            self._counting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._counting
            self._counting = None

    async def _tail(self, deadline: float) -> None:
        """Count the events past the tally's floor in batches (a process that falls behind catches
        up over a few scrapes, meanwhile leaving its job counters out: lower than the last
        process's, they would read as a reset)."""
        after = self.tally.floor
        while time.monotonic() < deadline:
            after = self.tally.ids.next_read(after)  # holes that may fill, then what is new
            rows = await self._manager.reports.events_for_metrics(after=after, limit=self._batch)
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
        if self._depth is not None:  # zeros before the first read would say the queue is empty
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
    running jobs (none once they are taken back); its GPUs and `paused` are left out, since the
    snapshot of a dead worker's reservations, jobs, runners and storage is no longer true.
    """
    age = GaugeMetricFamily(
        "gpujobs_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat", labels=["worker"]
    )
    running = GaugeMetricFamily("gpujobs_worker_running_jobs", "Jobs the worker runs", labels=["worker"])
    paused = GaugeMetricFamily(
        "gpujobs_worker_paused",
        "1 while the worker claims nothing (its storage folder takes no file), else 0",
        labels=["worker"],
    )
    gpus = _GpuFamilies()
    for w in workers:
        if w.state == "stopped":
            continue
        age.add_metric([w.id], w.heartbeat_age_s)
        running.add_metric([w.id], len(w.running_jobs))
        if w.state in ("running", "stopping") and w.heartbeat_age_s < dead_after_s:
            paused.add_metric([w.id], 0 if w.paused is None else 1)
            for g in w.gpus:
                gpus.add(w.id, g)
    yield from (age, running, paused, *gpus.families())


class StorageMetrics:
    """The size and free bytes of each storage part's disk, read at each scrape (a prometheus
    Collector): a disk filling up shows here before uploads fail and workers pause."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def collect(self) -> Iterable[Metric]:
        """Two gauges by part (results, logs, scratch, pgdata): the disk's size and its free bytes."""
        size = GaugeMetricFamily(
            "gpujobs_storage_size_bytes", "Size of the storage part's disk", labels=["part"]
        )
        free = GaugeMetricFamily(
            "gpujobs_storage_free_bytes", "Free bytes on the storage part's disk", labels=["part"]
        )
        for part, (total, left) in retention.disk_space(self._root).items():
            size.add_metric([part], total)
            free.add_metric([part], left)
        yield from (size, free)


class _GpuFamilies:
    """The per GPU gauges, filled one GPU of a worker's heartbeat snapshot at a time."""

    MEMORY = ("total", "free", "reserved")

    def __init__(self) -> None:
        labels = ["worker", "gpu", "name"]
        self.memory = {
            n: GaugeMetricFamily(f"gpujobs_gpu_memory_{n}_bytes", f"GPU memory: {n}", labels=labels)
            for n in self.MEMORY
        }
        self.jobs = GaugeMetricFamily("gpujobs_gpu_running_jobs", "Jobs on the GPU", labels=labels)
        self.unreadable = GaugeMetricFamily(
            "gpujobs_gpu_unreadable",
            "1 while NVML cannot read the GPU (fallen off the bus, say): it takes no jobs meanwhile",
            labels=labels,
        )
        self.warm = GaugeMetricFamily(
            "gpujobs_warm_runners",
            "Warm runners on the GPU, by model and state",
            labels=["worker", "gpu", "model", "state"],
        )
        self.starts = CounterMetricFamily(
            "gpujobs_warm_runner_starts",
            "Warm runners started on the GPU since its worker started, by model",
            labels=["worker", "gpu", "model"],
        )

    def add(self, worker: str, g: Mapping[str, Any]) -> None:
        """One GPU of `worker`'s snapshot (as heartbeats write it: app/queue/gpubook.py)."""
        index = str(g.get("index", "?"))
        labels = [worker, index, str(g.get("name", ""))]
        for n in self.MEMORY:
            self.memory[n].add_metric(labels, int(g.get(f"{n}_mb") or 0) * MB)
        self.jobs.add_metric(labels, int(g.get("running_jobs") or 0))
        self.unreadable.add_metric(labels, int(g.get("error") is not None))
        states = Counter((str(r.get("model")), str(r.get("state"))) for r in g.get("warm") or ())
        for (model, state), count in sorted(states.items()):
            self.warm.add_metric([worker, index, model, state], count)
        for model, count in sorted((g.get("warm_starts") or {}).items()):
            self.starts.add_metric([worker, index, model], int(count))

    def families(self) -> tuple[Metric, ...]:
        """Every family, in the order /metrics lists them."""
        return (*self.memory.values(), self.jobs, self.unreadable, self.warm, self.starts)


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
        storage_dir: Path | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.database = DatabaseMetrics(manager, cache_s=cache_s, dead_after_s=dead_after_s, models=models)
        self.registry.register(self.database)
        if storage_dir is not None:
            self.registry.register(StorageMetrics(storage_dir))
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

    async def aclose(self) -> None:
        """Stop what the registry still reads in the background (at the process's end)."""
        await self.database.aclose()
