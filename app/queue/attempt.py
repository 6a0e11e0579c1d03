"""Attempt: one claimed run of a job, from scratch folder to final write.

An attempt never holds a database connection while its model runs. Every write it makes is fenced
by (job id, attempt): when a write finds the job gone (lease expired and taken back, canceled,
or a newer attempt), the attempt kills its process and discards what it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from app import (
    db,
    errors,
    gpu,
    logs,
    modelkit,
    registry,
    runner,
    scheduler,
    storage,
    warm,
    warmpool,
    warmresult,
)
from app.queue import leftovers
from app.queue import manager as manager_
from app.queue.jobs import PROGRESS_MESSAGE_CHARS, Job, JobState, ResultFile

log = logging.getLogger("gpujobs.worker")
T = TypeVar("T")

EXTENSIONS = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp"}

PID_AFTER_S = 0.5
RECORD_PID_WAIT_S = 5.0  # the most a run's end waits for its pid's statement to finish
# Outputs up to this size are hashed on the event loop (about a millisecond); larger ones in a thread.
_HASH_ON_LOOP_BYTES = 1 << 20

# Reasons a run is stopped from outside, and what the attempt then writes.
CANCELED = "canceled"
LEASE_LOST = "lease lost"
SHUTDOWN = "worker shutting down"
# A job whose files this host could not write goes back to the queue with this reason, no attempt
# spent, at most STORAGE_RETURNS_MAX times: one whose own outputs fill any disk must end, not go
# round the workers for ever, pausing the claims of each (its later tries spend attempts).
STORAGE = "storage unusable"
STORAGE_RETURNS_MAX = 3
# Claimed while another job's files failed to be written: claims pause, and it goes back, unrun.
PAUSED = "claims paused: the worker's storage is unusable"


@dataclass(frozen=True, slots=True)
class AttemptConfig:
    """The worker settings an attempt needs."""

    worker_id: str
    kill_grace_s: float
    retry_base_s: float
    retry_max_s: float
    python: str
    oom_max_retries: int = 2
    oom_growth: float = 1.5
    sample_interval_s: float = 0.5  # how often the model's GPU memory is read (NVML)
    max_log_bytes: int = 0  # the cap on the attempt's log (0: none)


def retry_delay_s(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff with jitter: about base * 2^(attempt-1), between half and all of it."""
    ceiling = min(max_s, base_s * 2 ** max(attempt - 1, 0))
    return random.uniform(ceiling / 2, ceiling)


def storable(text: str) -> str:
    """A model's words as PostgreSQL can store them: a NUL (which no text column nor jsonb takes,
    and which failed the whole final write) becomes U+FFFD."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def signal_name(number: int) -> str:
    """SIGSEGV, SIGRTMIN+6 (the real-time signals between SIGRTMIN and SIGRTMAX have no name of
    their own), or "signal N"."""
    try:
        return signal.Signals(number).name
    except ValueError:
        if signal.SIGRTMIN < number < signal.SIGRTMAX:
            return f"SIGRTMIN+{number - signal.SIGRTMIN}"
        return f"signal {number}"


def describe(result: runner.RunResult, timeout_s: float) -> str:
    """A one-paragraph error for the job row: what ended the run, and the log's last lines."""
    if result.timed_out:
        head = f"timed out after {timeout_s:g} s"
    elif result.signal is not None:
        head = f"killed by {signal_name(result.signal)}"
    else:
        head = f"exit code {result.exit_code}"
    tail = result.log_tail.strip()
    return f"{head}\n--- last lines of the log ---\n{tail}" if tail else head


class Attempt:
    """Runs one claimed job on one GPU and records the outcome."""

    def __init__(
        self,
        job: Job,
        *,
        lane: Path,
        spec: registry.ModelSpec,
        manager: manager_.JobManager,
        store: storage.ResultStore,
        config: AttemptConfig,
        inventory: gpu.GpuInventory | None = None,
        capacity_mb: int = 0,
        image: tuple[str, bytes] | None = None,
        pool: warmpool.WarmPool | None = None,
        slot: asyncio.Semaphore | None = None,
        room: asyncio.Event | None = None,
        on_model_end: Callable[[Attempt], None] | None = None,
        on_storage_trouble: Callable[[Attempt], None] | None = None,
        live_runs: Callable[[], Set[str]] = frozenset,
    ) -> None:
        self.job = job
        # The scratch folder (cwd, HOME, input, out/); one of the worker's lanes, emptied after.
        self.lane = lane
        self.lane_clean = False  # whether the lane was emptied, and may take another job
        # Set once the model is done with the GPU (its process exited, or its warm runner answered):
        # from then on only the outcome is written, and the worker may hand the GPU slot on.
        self.model_ended = False
        self.model_started_s: float | None = None  # when it took its GPU slot and its model started
        # Why the job's files could not be written (a full disk, a read-only folder), if they could
        # not: the worker then claims nothing until its storage folder takes a file again.
        self.storage_trouble: str | None = None
        self._slot = slot  # its GPU's slots under max_jobs_per_gpu: a job claimed ahead waits for one
        self._room = room  # set once the worker has evicted the idle runners whose memory it needs
        self._on_model_end = on_model_end
        self._on_storage_trouble = on_storage_trouble
        self._live_runs = live_runs  # the worker's runs still going, as `run <job id>:<attempt>`
        self.spec = spec
        self._manager = manager
        self._store = store
        self._config = config
        self._inventory = inventory
        self._image = image  # (media type, bytes) when the claim brought it
        self._pool = pool  # warm runners, for persistent models
        self._runner: warm.WarmRunner | None = None
        self._capacity_mb = capacity_mb  # the largest GPU less the buffer: the most an estimate may grow to
        self.started_s = time.monotonic()
        self.peak_mb: int | None = None  # most GPU memory the model's processes were seen using
        self.gpu_pids: set[int] = set()  # the model's processes seen holding GPU memory
        self.seen_mb = 0  # what they held at the last reading, at least what is known to be loaded
        self._loaded_mb = 0  # a warm runner's model, in GPU memory before the job came
        self._process: runner.ModelProcess | None = None
        self._stop_reason: str | None = None
        self._stopped = asyncio.Event()  # set with _stop_reason: ends a wait for a busy warm runner
        self._waiting: asyncio.Future[Any] | None = None  # the wait for its room or slot, if any
        self._abandoned = False  # the worker stops at once: nothing more is written
        self._final: asyncio.Future[None] | None = None  # the final write, once under way
        self._milestone = 0

    @property
    def gpu(self) -> int:
        """The GPU index the claim placed this job on."""
        assert self.job.gpu is not None
        return self.job.gpu

    def stop(self, reason: str) -> None:
        """Ask the model process to stop (cancel, lease lost, shutdown); the run then ends."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stopped.set()
        if self._waiting is not None:  # for its room or its GPU slot: it stops waiting at once
            self._waiting.cancel()
        if self._process is not None:
            self._process.stop(reason)
        if self._runner is not None:
            self._runner.stop(reason)

    def abandon(self) -> None:
        """The worker stops at once: the model is killed now (SIGKILL to its group; its warm runner
        is the pool's to kill) and this attempt writes nothing, a final write under way cancelled.
        The worker then hands the job back itself once every model is dead (`Worker.stop_now`), or
        leaves it to its restart or its lease if the database does not answer in time."""
        self._abandoned = True
        self.stop(SHUTDOWN)
        if self._process is not None:
            self._process.kill()
        if self._final is not None:
            self._final.cancel()

    async def run(self) -> None:
        """Prepare, run the model, and write the outcome (the final write survives cancellation)."""
        job = self.job
        logs.bind(job_id=str(job.id), attempt=job.attempt)  # this task's log context
        extra = {"job_id": str(job.id), "attempt": job.attempt, "gpu": job.gpu}
        log.info("job started", extra={"action": "job_started", **extra})
        try:
            outcome = await self._run_in_slot()
        except errors.LeaseLost:
            log.warning("lease lost while the model ran", extra={"action": "lease_lost", **extra})
            outcome = None
        except Exception as exc:
            if db.is_unavailable(exc):  # nothing can be written; the lease runs out, the job comes back
                log.warning("database unavailable before the model ran", extra={"action": "db_down", **extra})
                outcome = None
            else:
                log.exception(
                    "attempt failed inside the worker", extra={"action": "attempt_crashed", **extra}
                )
                outcome = self._failure(f"internal error in the worker: {exc!r}", retryable=True)
        else:  # the model is done: its slot may go on while the outcome is written
            self.model_ended = True
            if self._on_model_end is not None:
                self._on_model_end(self)
        if outcome is not None and not self._abandoned:
            self._final = asyncio.ensure_future(self._persist_or_fail(outcome))
            await asyncio.shield(self._final)  # cancelled only by abandon()
        self.lane_clean = await self._clear_lane()  # ready for the worker's next job
        # The outcome's own line (job_succeeded, job_failed, lease_lost...) said how it ended.
        log.debug("job attempt ended", extra={"action": "job_ended", **extra})

    async def _clear_lane(self) -> bool:
        """Empty the lane for the next job (lanes.Lanes.clear); whether it was. In a
        thread when the model left something there: tens of thousands of files took the event loop
        (heartbeats, the other jobs' pipes) for half a second."""
        if self._store.lanes.is_clear(self.lane):
            return True
        return await asyncio.to_thread(self._store.lanes.clear, self.lane)

    async def _run_in_slot(self) -> Callable[[], Awaitable[Any]] | None:
        """Wait for its room (idle runners evicted) and a slot on the GPU (a job claimed ahead
        waits until a running one ends), then run the model. Stopped while it waited (cancel,
        lease lost, shutdown), it stops waiting at once and runs no model."""
        held = await self._take_slot()
        try:
            if self._stop_reason is not None:
                return self._stopped_outcome(self._stop_reason)
            self.model_started_s = time.monotonic()
            return await self._run_model()
        finally:
            if held and self._slot is not None:
                self._slot.release()

    async def _take_slot(self) -> bool:
        """Wait for the room, then take a GPU slot, unless stopped first; whether a slot is held."""
        if self._room is not None and not self._room.is_set():
            await self._unless_stopped(self._room.wait())
        if self._slot is None or self._stop_reason is not None:
            return False
        if not self._slot.locked():  # free: taken at once, no task made
            await self._slot.acquire()
            return True
        return await self._unless_stopped(self._slot.acquire())

    async def _unless_stopped(self, waiting: Awaitable[Any]) -> bool:
        """Await `waiting` in a task that `stop` cancels (a semaphore's acquire gives back a slot
        handed over as it is cancelled); whether it ended, False when stopped first."""
        self._waiting = task = asyncio.ensure_future(waiting)
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._stop_reason is None or (current is not None and current.cancelling()):
                raise  # this attempt's own task was cancelled, not only its wait
            return False
        finally:
            self._waiting = None
        return True

    async def _run_model(self) -> Callable[[], Awaitable[Any]] | None:
        """Run the process; return the final write to make (None: this attempt lost the job)."""
        job, spec = self.job, self.spec
        try:  # checked at submit, but the registry may have changed since
            params = spec.validate_params(job.params)
        except errors.InvalidParams as exc:
            changed = f"the model no longer takes the job's params: {exc.message}"
            return self._failure(changed, retryable=False)
        media_type, data = self._image or await self._manager.input_by_id(job.input_id)
        self._image = None  # not kept in memory while the model runs
        input_name = f"input{EXTENSIONS.get(media_type, '')}"
        scratch = self.lane
        try:
            self._store.lanes.prepare(scratch, input_name, data)
            if spec.persistent and self._pool is not None:  # its runner's folder too (made once)
                self._store.runner_dir(spec.name, job.gpu)
        except OSError as exc:  # a full disk, say: this host's trouble, which db.is_unavailable would
            # take for the database's (then nothing is written and the job waits out its lease)
            return self._storage_failed(f"could not prepare the scratch folder: {exc}")
        del data
        input_path, log_path = scratch / input_name, self._store.log_path(job.id, job.attempt)
        if spec.persistent and self._pool is not None:
            return await self._run_warm(input_path, scratch / "out", log_path, params)
        return await self._run_oneshot(input_path, log_path, params)

    async def _run_oneshot(
        self, input_path: Path, log_path: Path, params: Mapping[str, registry.Value]
    ) -> Callable[[], Awaitable[Any]] | None:
        """Run the model as a process of its own in the lane; the final write to make."""
        job, spec, scratch = self.job, self.spec, self.lane
        argv = spec.build_argv(
            params, input_path=input_path, output_dir=scratch / "out", python=self._config.python
        )
        process = runner.ModelProcess(
            argv,
            cwd=scratch,
            env=self._oneshot_env(),
            log_path=log_path,
            timeout_s=spec.timeout_s,
            kill_grace_s=self._config.kill_grace_s,
            max_log_bytes=self._config.max_log_bytes,
            on_progress=self._on_progress,
        )
        try:
            pid = await process.start()
        except OSError as exc:
            never = runner.cannot_start(exc) and scratch.is_dir()  # else this host's passing trouble
            return self._failure(f"the model could not be started: {exc}", retryable=not never)
        self._process = process
        if self._stop_reason is not None:
            process.stop(self._stop_reason)
        result = await self._watched(pid, process.wait())
        await self._kill_adopted()  # before its outputs are read, and its lane reused
        if result.escaped or not result.ok:  # what left the run's group dies before the lane is reused
            await leftovers.kill_run_strays(job.id, job.attempt)
        failed = not result.ok and not result.timed_out and self._stopped_by(result.stopped) is None
        if failed and (trouble := await self._disk_trouble(result.log_tail)) is not None:
            return self._after_peak(self._storage_failed(trouble))
        return self._after_peak(self._outcome(result, scratch / "out"))

    async def _kill_adopted(self) -> None:
        """Kill what the run left that came to the worker (a subreaper, app/subreaper.py) as the
        run's process exited: a daemon with its pipes let go of, which neither the group's kill
        nor the run's end saw, lived until the next reap round, while its lane went to the next
        job (another user's), whose outputs it replaced, as it did its own run's between their
        hash and their publishing. A look at the worker's own children: no scan of /proc."""
        await leftovers.kill_adopted(self._config.worker_id, self._live_runs, job=self.job)

    def _oneshot_env(self) -> dict[str, str]:
        """The environment of a one-shot run: the minimal one, its GPU, and the markers a restart
        and the reaper find its processes by. Its temporary files go in its lane (TMPDIR, and TMP
        and TEMP that some programs read instead), emptied after it: in the host's /tmp, those of
        a run killed at its timeout or canceled stayed for good. (The lane itself, not a folder
        made in it: every folder made and freed per run costs on a busy disk.)"""
        # PCI bus order makes CUDA's device numbers the same as NVML's (the inventory's).
        lane = str(self.lane)
        return runner.minimal_env(
            self.gpu,
            {
                "HOME": lane,
                "TMPDIR": lane,
                "TMP": lane,
                "TEMP": lane,
                "GPUJOBS_JOB": f"{self.job.id}:{self.job.attempt}",
                "GPUJOBS_WORKER": self._config.worker_id,  # a restart finds its runs by it
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            },
        )

    async def _disk_trouble(self, *said: str) -> str | None:
        """Why a run that failed by itself failed for this host's storage, not for the job (None:
        nothing says so): what it said last names a full disk (ENOSPC, EDQUOT), or the storage
        folder no longer takes the probe's file (storage.ResultStore.probe), the run's partial
        outputs still in its lane. (A model that died writing its outputs to a full disk was
        counted as failing: the job spent an attempt, and the worker went on claiming.)"""
        line = storage.full_disk_line("\n".join(said))
        if line is not None:
            return f"the model ran out of disk space: {line}"
        try:
            await asyncio.to_thread(self._store.probe, self._config.worker_id)
        except OSError as exc:
            return f"the storage folder takes no file after the run: {exc}"
        return None

    async def _run_warm(
        self, input_path: Path, out_dir: Path, log_path: Path, params: Mapping[str, registry.Value]
    ) -> Callable[[], Awaitable[Any]] | None:
        """Run the job in a warm runner of its model on its GPU: an idle one, else a new one or the
        first busy one to come free (app/warmpool.py). Stopped while it waits, it runs nothing."""
        assert self._pool is not None
        job, spec = self.job, self.spec
        key = warmpool.RunnerKey(spec.name, job.gpu)
        try:
            hold_mb = spec.base_mb if spec.idle_vram_mb is None else spec.idle_vram_mb  # 0 is 0
            runner = await self._pool.acquire(
                key, functools.partial(self._launch, key), hold_mb=hold_mb, give_up=self._stopped
            )
        except warmpool.GaveUp:
            return self._stopped_outcome(self._stop_reason or SHUTDOWN)  # or the pool closed
        except warm.StartFailed as exc:
            if spec.out_of_memory(exc.exit_code, str(exc)):
                return self._out_of_memory(f"the warm runner did not load: {exc}")
            # As for a one-shot run: a missing program fails at once; a failed load is retried.
            return self._failure(f"the warm runner did not start: {exc}", retryable=not exc.permanent)
        self._runner = runner
        self.seen_mb = self._loaded_mb = hold_mb  # loaded: NVML's free figure counts it already
        # What the success event says of the runner: its pid, which of its jobs this is, and the
        # model's load when this job was its first (the job waited for it).
        about: dict[str, Any] = {"runner_pid": runner.pid, "runner_job": runner.jobs_done + 1}
        if runner.jobs_done == 0 and runner.load_s is not None:
            about["load_s"] = round(runner.load_s, 3)
        try:
            if self._stop_reason is not None:
                runner.stop(self._stop_reason)
            request = modelkit.Request(f"{job.id}:{job.attempt}", input_path, out_dir, params)
            result = await self._watched(
                runner.pid or 0,
                runner.run_job(
                    request,
                    timeout_s=spec.timeout_s,
                    log_path=log_path,
                    on_progress=self._on_progress,
                ),
            )
        finally:
            self._runner = None
            # Idle, it holds what NVML last showed it using, if more than it was given: a model's
            # cache allocator keeps what the job used (seen_mb starts at hold_mb).
            self._pool.release(runner, hold_mb=self.seen_mb)
        if runner.state is not warm.RunnerState.DEAD:
            self.gpu_pids.clear()  # the pool counts a live runner's memory, not the settling list
        return await self._unless_disk_trouble(result) or self._warm_outcome(result, out_dir, about)

    async def _unless_disk_trouble(
        self, result: warmresult.WarmResult
    ) -> Callable[[], Awaitable[Any]] | None:
        """For a warm job that failed by itself (the model's error, or its runner's death) for this
        host's storage (`_disk_trouble`), the storage failure's final write; else None."""
        failed = result.outcome in (warmresult.Outcome.FAILED, warmresult.Outcome.CRASHED)
        if not failed or self._stopped_by(result.stopped) is not None:
            return None
        # The error last: its line, the model's own words, is the one quoted (the last found).
        trouble = await self._disk_trouble(result.log_tail, result.error or "")
        return None if trouble is None else self._storage_failed(trouble)

    def _launch(self, key: warmpool.RunnerKey) -> warm.Launch:
        """How to start a warm runner: its own folder, log and minimal environment."""
        folder = self._store.runner_dir(key.model, key.gpu)
        env = runner.minimal_env(
            key.gpu,
            {
                "HOME": str(folder),
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "GPUJOBS_RUNNER": f"{self._config.worker_id}:{key.model}:{key.gpu}",
            },
        )
        argv = tuple(self.spec.build_serve_argv(python=self._config.python))
        return warm.Launch(
            f"{key.model} on GPU {key.gpu}",
            argv,
            env,
            folder,
            folder / "runner.log",
            load_timeout_s=self.spec.load_timeout_s,
        )

    def _warm_outcome(
        self, result: warmresult.WarmResult, out_dir: Path, about: Mapping[str, Any]
    ) -> Callable[[], Awaitable[Any]] | None:
        """The final write for a job run in a warm runner."""
        stopped = self._stopped_by(result.stopped)
        if stopped is not None or result.outcome is warmresult.Outcome.STOPPED:
            return self._stopped_outcome(stopped or CANCELED)
        error = result.error or str(result.outcome)
        match result.outcome:
            case warmresult.Outcome.DONE:
                return self._success(out_dir, result.duration_s, about)
            case warmresult.Outcome.BAD_INPUT:
                return self._failure(f"bad input: {error}", retryable=False)
            case warmresult.Outcome.OOM:
                return self._out_of_memory(error)
            case warmresult.Outcome.TIMED_OUT:
                return self._failure(
                    f"timed out after {self.spec.timeout_s:g} s", retryable=True, timed_out=True
                )
            case warmresult.Outcome.CRASHED:
                return self._failure(
                    f"the warm runner died: {error}\n{result.log_tail}".strip(),
                    retryable=True,
                    exit_code=result.exit_code,
                    signal=result.signal,
                    abnormal=True,
                )
            case _:
                return self._failure(f"the model failed: {error}", retryable=True)

    async def _watched(self, pgid: int, work: Awaitable[T]) -> T:
        """Await `work` while recording the pid once it lasts and sampling its GPU memory.

        The pid is recorded once the run has lasted PID_AFTER_S: only a lasting run leaves an
        orphan worth killing after a crash, and quick jobs are spared the round trip (and the
        task: a timer costs less).
        """
        side: list[asyncio.Task[None]] = []
        recording: list[asyncio.Task[None]] = []

        def record_pid() -> None:
            if self._stop_reason is None:
                recording.append(asyncio.create_task(self._record_pid(pgid), name=f"pid:{self.job.id}"))

        timer = asyncio.get_running_loop().call_later(PID_AFTER_S, record_pid)
        if self._inventory is not None and not isinstance(self._inventory, gpu.VirtualInventory):
            side.append(asyncio.create_task(self._sample_memory(pgid), name=f"vram:{self.job.id}"))
        try:
            return await work
        finally:
            timer.cancel()
            # A pid being recorded is one short statement, let it end: cut off, it would roll back
            # its `started` event and leave a hole in the event ids, which the metrics then wait on.
            if recording:
                await asyncio.wait(recording, timeout=RECORD_PID_WAIT_S)
            for task in (*side, *recording):
                task.cancel()
            await asyncio.gather(*side, *recording, return_exceptions=True)

    async def _record_pid(self, pid: int) -> None:
        """Record the pid (best effort while the database is away) and honour a pending cancel."""
        try:
            if await self._manager.set_pid(self.job, pid):
                self.stop(CANCELED)
        except errors.LeaseLost:
            self.stop(LEASE_LOST)
        except Exception as exc:
            if not db.is_unavailable(exc):
                self.stop(f"internal error: {exc!r}")
                raise

    def _outcome(self, result: runner.RunResult, out_dir: Path) -> Callable[[], Awaitable[Any]] | None:
        """The final write for a one-shot run."""
        stopped = self._stopped_by(result.stopped)
        if stopped is not None:
            return self._stopped_outcome(stopped)
        if result.ok:
            return self._success(out_dir, result.duration_s)
        if not result.timed_out and self.spec.out_of_memory(result.exit_code, result.log_tail):
            return self._out_of_memory(describe(result, self.spec.timeout_s))
        # A model stopped at its timeout may answer SIGTERM with any code: it stays a timeout.
        bad_input = not result.timed_out and result.exit_code in self.spec.bad_input_exit_codes
        error = describe(result, self.spec.timeout_s)
        return self._failure(
            ("bad input: " if bad_input else "") + error,
            retryable=not bad_input,
            exit_code=result.exit_code,
            signal=result.signal,
            timed_out=result.timed_out,
            abnormal=result.signal is not None and not result.timed_out,  # a signal we did not send
        )

    def _after_peak(self, write: Callable[[], Awaitable[Any]] | None) -> Callable[[], Awaitable[Any]] | None:
        """`write` (the final write), preceded by the run's peak GPU memory, if NVML showed one: one
        write, which `_persist` retries whole through a database outage. The peak goes first, while
        the job is still running (the statement is fenced on that). Written apart, before, an outage
        took it for one before the model ran, and the outcome was never written."""
        peak = self.peak_mb
        if not peak or write is None:
            return write

        async def peak_then_write() -> Any:
            with contextlib.suppress(errors.LeaseLost):  # the outcome's own write meets it too
                await self._manager.record_peak(self.job, peak)
            return await write()

        return peak_then_write

    def _stopped_by(self, run_stopped: str | None) -> str | None:
        """Why the run counts as stopped: the stop that ended it, or one that came after it ended
        by itself (while its last progress or pid was written), but for a shutdown: the outcome of
        a run that ended is written, not handed back to be run again."""
        if run_stopped is not None or self._stop_reason == SHUTDOWN:
            return run_stopped
        return self._stop_reason

    def _stopped_outcome(self, reason: str) -> Callable[[], Awaitable[Any]] | None:
        """A run stopped from outside: lost (discard), shutdown (hand back), canceled, or broken."""
        if reason == LEASE_LOST:
            log.warning(
                "lease lost; output discarded", extra={"action": "lease_lost", "job_id": str(self.job.id)}
            )
            return None
        if reason in (SHUTDOWN, PAUSED):
            return functools.partial(self._hand_back, reason)
        if reason == CANCELED:
            return self._failure("canceled while running", retryable=False)
        return self._failure(f"stopped: {reason}", retryable=True)

    async def _hand_back(self, reason: str) -> None:
        """The worker is stopping, or pausing its claims: the job goes back to the queue, no
        attempt spent."""
        if await self._unless_canceled(self._manager.release(self.job, reason=reason)):
            extra = {"action": "job_released", "job_id": str(self.job.id)}
            log.info("job handed back: %s", reason, extra=extra)

    def _out_of_memory(self, what: str) -> Callable[[], Awaitable[Any]]:
        """Queue again with a larger estimate (no attempt spent), or fail once that cannot help."""
        job = self.job
        grown = scheduler.after_oom_mb(
            job.vram_mb, self.peak_mb, growth=self._config.oom_growth, capacity_mb=self._capacity_mb
        )
        error = "out of GPU memory: " + storable(what)
        if job.oom_retries >= self._config.oom_max_retries or grown <= job.vram_mb:
            why = f"{job.oom_retries} larger retries" if grown > job.vram_mb else "the whole GPU"
            return self._failure(f"{error}\n(still out of memory with {why})", retryable=False)
        detail = {
            "vram_mb": job.vram_mb,
            "new_vram_mb": grown,
            "peak_mb": self.peak_mb,
            "oom_retry": job.oom_retries + 1,
        }
        return lambda: self._unless_canceled(
            self._manager.requeue_oom(job, vram_mb=grown, error=error, detail=detail)
        )

    async def _unless_canceled(self, requeue: Awaitable[None]) -> bool:
        """Queue the job again without spending an attempt (a hand-back, an out-of-memory retry);
        whether it was. Those statements refuse a job whose cancel is pending: it ends canceled
        instead, now, not after its lease runs out. A job truly lost is refused by that write too
        (LeaseLost)."""
        try:
            await requeue
        except errors.LeaseLost:
            await self._failure("canceled while running", retryable=False)()
            return False
        return True

    async def _sample_memory(self, pgid: int) -> None:
        """Track the peak GPU memory of the model's process group while it runs (NVML)."""
        assert self._inventory is not None
        while True:
            try:
                usage = await asyncio.to_thread(gpu.group_usage_mb, self._inventory, pgid)
            except errors.AppError:  # NVML failed (a driver hiccup): read again at the next tick
                await asyncio.sleep(self._config.sample_interval_s)
                continue
            self.gpu_pids.update(usage)
            total = sum(usage.values())
            self.seen_mb = max(total, self._loaded_mb)
            if total and total > (self.peak_mb or 0):
                self.peak_mb = total
            await asyncio.sleep(self._config.sample_interval_s)

    def _storage_failed(self, error: str) -> Callable[[], Awaitable[Any]]:
        """The final write for files this host could not write (a full disk, a folder gone
        read-only), which the worker is told of (it pauses its claims): the job goes back to the
        queue, no attempt spent, as the host's trouble is not the job's; past STORAGE_RETURNS_MAX
        returns, the attempt fails, to be retried."""
        self.storage_trouble = error
        if self._on_storage_trouble is not None:
            self._on_storage_trouble(self)
        failure = self._failure(error, retryable=True)

        async def write() -> None:
            try:
                back = await self._manager.release_storage(
                    self.job, reason=STORAGE, error=storable(error), most=STORAGE_RETURNS_MAX
                )
            except errors.LeaseLost:  # its cancel is pending (a job truly lost meets that write too)
                await self._failure("canceled while running", retryable=False)()
                return
            if not back:
                await failure()
                return
            extra = {"action": "job_released", "job_id": str(self.job.id)}
            log.info("job handed back, no attempt spent: %s", error.splitlines()[0], extra=extra)

        return write

    def _failure(self, error: str, *, retryable: bool, **detail: Any) -> Callable[[], Awaitable[Any]]:
        delay = retry_delay_s(self.job.attempt, self._config.retry_base_s, self._config.retry_max_s)
        abnormal, error = bool(detail.pop("abnormal", False)), storable(error)
        detail = {"error": error.splitlines()[0], "retryable": retryable, **detail}

        async def write() -> None:
            state = await self._manager.fail(
                self.job, error=error, retryable=retryable, delay_s=delay, detail=detail, abnormal=abnormal
            )
            if state.final and self.job.attempt > 1:  # an earlier attempt's worker may have died storing
                await asyncio.to_thread(self._store.drop_attempts, self.job.id, upto=self.job.attempt)
            log.info("job %s", state, extra={"action": f"job_{state}", "job_id": str(self.job.id)})

        return write

    def _success(
        self, out_dir: Path, duration_s: float, about: Mapping[str, Any] | None = None
    ) -> Callable[[], Awaitable[Any]]:
        """The final write of a run whose model succeeded: its outputs checked, published, and the
        job marked succeeded; `about` goes into the event's detail beside `duration_s`."""
        expected = [
            storage.ExpectedOutput(name, media_type, spec.required, spec.max_mb * 1024 * 1024)
            for name, media_type, spec in self.spec.expected_outputs(self.job.params)
        ]
        job = self.job
        published = unsure = False
        files: list[ResultFile] | None = None

        async def write() -> None:
            # Check and publish once; a retry after a database outage repeats only the database write.
            nonlocal published, unsure, files
            if files is None:
                try:
                    files = await self._checked_outputs(out_dir, expected)
                except storage.OutputInvalid as exc:
                    await self._failure(f"bad output: {exc.message}", retryable=False)()
                    return
                except errors.StorageError as exc:  # its cause, an OSError, reads as a database outage
                    await self._storage_failed(f"could not store the results: {exc.__cause__ or exc}")()
                    return
                except OSError as exc:  # as in _run_model: not to be taken for a database outage
                    await self._failure(f"could not read the outputs: {exc}", retryable=True)()
                    return
            if not published and files:
                try:  # in a thread: its fsyncs may take a while on a busy disk
                    await asyncio.to_thread(self._store.publish, job.id, job.attempt, files)
                except errors.StorageError as exc:  # its cause, an OSError, reads as a database outage
                    await self._storage_failed(f"could not store the results: {exc.__cause__ or exc}")()
                    return
            published = True
            try:
                await self._manager.succeed(job, files, {"duration_s": round(duration_s, 3), **(about or {})})
            except Exception as exc:
                if db.is_unavailable(exc):  # the write may have committed before the answer was lost
                    unsure = True
                    raise
                # Lost to fencing, or broken: the files must not stay. Unless an earlier try did
                # commit, and the job is ours and succeeded already.
                if not (unsure and isinstance(exc, errors.LeaseLost) and await self._succeeded_already()):
                    self._store.unpublish(job.id, job.attempt)
                    raise
            if job.attempt > 1:  # an earlier attempt's worker may have died storing its results
                await asyncio.to_thread(self._store.drop_attempts, job.id, upto=job.attempt - 1)
            log.info("job succeeded", extra={"action": "job_succeeded", "job_id": str(job.id)})

        return write

    async def _checked_outputs(
        self, out_dir: Path, expected: list[storage.ExpectedOutput]
    ) -> list[ResultFile]:
        """The outputs moved out of the lane into the attempt's staging folder, checked there
        (store.stage) and hashed; the hashing, which reads every output whole, in a thread once
        they are large, so the worker's loop (its heartbeats, the other jobs' pipes, the API under
        `serve`) goes on. Hashed in the lane, an output could be replaced by path (by a process the
        run left behind) between its hash and its publishing."""
        job = self.job
        found = self._store.stage(job.id, job.attempt, out_dir, expected)
        try:
            if sum(f.size for f in found) <= _HASH_ON_LOOP_BYTES:
                return storage.hash_outputs(found)
            return await asyncio.to_thread(storage.hash_outputs, found)
        except BaseException:
            self._store.unstage(job.id, job.attempt)
            raise

    async def _succeeded_already(self) -> bool:
        """Whether this attempt's success is in the database (written by a try whose answer was lost)."""
        now = await self._manager.get(self.job.id)
        return now.state is JobState.succeeded and now.attempt == self.job.attempt

    async def _persist_or_fail(self, write: Callable[[], Awaitable[Any]]) -> None:
        """The final write; one that PostgreSQL refuses (not an outage) is replaced by a plain
        failure, to be retried. Else the job would stay running, with no error, until its lease ran
        out, and come back as a lost worker's (abnormal, counted towards quarantine)."""
        try:
            await self._persist(write)
        except Exception as exc:
            log.exception(
                "the outcome could not be written; failing the attempt instead",
                extra={"action": "outcome_refused", "job_id": str(self.job.id)},
            )
            refused = f"internal error in the worker: its outcome could not be written ({type(exc).__name__})"
            await self._persist(self._failure(refused, retryable=True))

    async def _persist(self, write: Callable[[], Awaitable[Any]]) -> None:
        """Make the final write, riding out a database outage; fencing decides if it still counts."""
        delay = 0.2
        while True:
            try:
                await write()
                return
            except errors.LeaseLost:
                log.warning(
                    "job lost before its result was written",
                    extra={"action": "lease_lost", "job_id": str(self.job.id)},
                )
                return
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
                log.warning("database unavailable; will retry the final write", extra={"action": "db_retry"})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _on_progress(self, fraction: float, message: str) -> None:
        """Record progress, and an event at each new quarter below 1. The feed that calls this
        (app/progress.py) hands on at most four updates a second, whatever their value, and the
        run's last one at its end, so every update that reaches here is written."""
        quarter = int(fraction * 4)
        message = storable(message[:PROGRESS_MESSAGE_CHARS])
        try:
            if await self._manager.progress(self.job, fraction, message):
                self.stop(CANCELED)
            if quarter > self._milestone and fraction < 1:
                self._milestone = quarter
                await self._manager.add_event(
                    self.job, "progress", {"progress": quarter / 4, "message": message}
                )
        except errors.LeaseLost:
            self.stop(LEASE_LOST)
        except Exception as exc:
            if not db.is_unavailable(exc):
                raise
            # Progress is best effort while the database is away; the run goes on.
