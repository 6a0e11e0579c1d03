"""Attempt: one claimed run of a job, from scratch folder to final write.

An attempt never holds a database connection while its model runs. Every write it makes is fenced
by (job id, attempt): when a write finds the job gone (lease expired and taken back, canceled,
or a newer attempt), the attempt kills its process and discards what it made. What a run's end
means, and the final write that records it, is app/queue/verdict.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any

from app import db, errors, logs, modelkit, registry, runner, warm, warmpool, warmresult
from app.queue import oneshot, verdict, warmrun, watch
from app.queue.jobs import PROGRESS_MESSAGE_CHARS, Job
from app.queue.site import Site
from app.runlog import RunLog

log = logging.getLogger("gpujobs.worker")

EXTENSIONS = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp"}

# Reasons a run is stopped from outside, and what the attempt then writes (`_stopped_outcome`).
CANCELED = "canceled"
LEASE_LOST = "lease lost"
SHUTDOWN = "worker shutting down"
# Runners a warm job may be given in turn while each is found gone before it took the job
# (warmresult.Outcome.GONE); past that, the last one's end is judged as a crash.
GONE_TRIES = 3
# Claimed while another job's files failed to be written: claims pause, and it goes back, unrun.
PAUSED = "claims paused: the worker's storage is unusable"


class Attempt:
    """Runs one claimed job on one GPU and records the outcome."""

    def __init__(
        self,
        job: Job,
        site: Site,
        *,
        lane: Path,
        spec: registry.ModelSpec,
        capacity_mb: int = 0,
        image: tuple[str, bytes] | None = None,
        slot: asyncio.Semaphore | None = None,
        room: asyncio.Event | None = None,
    ) -> None:
        self.job = job
        # The scratch folder (cwd, HOME, input, out/); one of the worker's lanes, emptied after.
        self.lane = lane
        self.lane_clean = False  # whether the lane was emptied, and may take another job
        # Set once the model is done with the GPU (its process exited, or its warm runner answered):
        # from then on only the outcome is written, and the worker may hand the GPU slot on.
        self.model_ended = False
        self.model_started_s: float | None = None  # when it took its GPU slot and its model started
        # Why its files could not be written (a full disk), if so: the worker then claims nothing.
        self.storage_trouble: str | None = None
        self._slot = slot  # its GPU's slots under max_jobs_per_gpu: a job claimed ahead waits for one
        self._room = room  # set once the worker has evicted the idle runners whose memory it needs
        self._site = site
        self.spec = spec
        self._image = image  # (media type, bytes) when the claim brought it
        self._runner: warm.WarmRunner | None = None
        self._verdict = self._verdict_of(capacity_mb)  # the final writes this attempt may make
        self.started_s = time.monotonic()
        self._process: runner.ModelProcess | None = None
        self._stop_reason: str | None = None
        self._stopped = asyncio.Event()  # set with _stop_reason: ends a wait for a busy warm runner
        self._watch = watch.Watch(
            job.id, site.inventory, self._site.config.sample_interval_s, self._stopped, self._record_pid
        )
        self._waiting: asyncio.Future[Any] | None = None  # the wait for its room or slot, if any
        self._abandoned = False  # the worker stops at once: nothing more is written
        self._final: asyncio.Future[None] | None = None  # the final write, once under way
        self._milestone = 0

    def _verdict_of(self, capacity_mb: int) -> verdict.Verdict:
        """How this attempt's run is judged and recorded; `capacity_mb` is the largest GPU less the
        buffer: the most an estimate may grow to after running out of memory."""
        config = self._site.config
        return verdict.Verdict(
            self.job,
            self.spec,
            manager=self._site.manager,
            store=self._site.store,
            worker_id=config.worker_id,
            retry_base_s=config.retry_base_s,
            retry_max_s=config.retry_max_s,
            oom_max_retries=config.oom_max_retries,
            oom_growth=config.oom_growth,
            capacity_mb=capacity_mb,
            on_storage_trouble=self._storage_trouble,
        )

    @property
    def gpu(self) -> int:
        """The GPU index the claim placed this job on."""
        assert self.job.gpu is not None
        return self.job.gpu

    @property
    def seen_mb(self) -> int:
        """What the model's processes held at the last reading, at least what is known to be loaded."""
        return self._watch.seen_mb

    @property
    def gpu_pids(self) -> set[int]:
        """The model's processes seen holding GPU memory."""
        return self._watch.gpu_pids

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
                outcome = self._verdict.failure(f"internal error in the worker: {exc!r}", retryable=True)
        else:  # the model is done: its slot may go on while the outcome is written
            self.model_ended = True
            if self._site.on_model_end is not None:
                self._site.on_model_end(self)
        if outcome is not None and not self._abandoned:
            self._final = asyncio.ensure_future(self._verdict.persist_or_fail(outcome))
            await asyncio.shield(self._final)  # cancelled only by abandon()
        self.lane_clean = await self._clear_lane()  # ready for the worker's next job
        # The outcome's own line (job_succeeded, job_failed, lease_lost...) said how it ended.
        log.debug("job attempt ended", extra={"action": "job_ended", **extra})

    async def _clear_lane(self) -> bool:
        """Empty the lane for the next job (lanes.Lanes.clear); whether it was. In a
        thread when the model left something there: tens of thousands of files took the event loop
        (heartbeats, the other jobs' pipes) for half a second."""
        if self._site.store.lanes.is_clear(self.lane):
            return True
        return await asyncio.to_thread(self._site.store.lanes.clear, self.lane)

    async def _run_in_slot(self) -> verdict.Write | None:
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

    async def _run_model(self) -> verdict.Write | None:
        """Run the process; return the final write to make (None: this attempt lost the job)."""
        job, spec = self.job, self.spec
        try:  # checked at submit, but the registry may have changed since
            params = spec.validate_params(job.params)
        except errors.InvalidParams as exc:
            changed = f"the model no longer takes the job's params: {exc.message}"
            self._say(changed)
            return self._verdict.failure(changed, retryable=False)
        media_type, data = self._image or await self._site.manager.inputs.by_id(job.input_id)
        self._image = None  # not kept in memory while the model runs
        input_name = f"input{EXTENSIONS.get(media_type, '')}"
        scratch = self.lane
        try:
            self._site.store.lanes.prepare(scratch, input_name, data)
            if spec.persistent and self._site.pool is not None:  # its runner's folder too (made once)
                self._site.store.runner_dir(spec.name, job.gpu)
        except OSError as exc:  # a full disk, say: this host's trouble, which db.is_unavailable would
            # take for the database's (then nothing is written and the job waits out its lease)
            why = f"could not prepare the scratch folder: {exc}"
            self._say(why)  # if the logs' disk takes it
            return self._verdict.storage_failed(why)
        del data
        input_path, log_path = scratch / input_name, self._site.store.log_path(job.id, job.attempt)
        if spec.persistent and self._site.pool is not None:
            return await self._run_warm(input_path, scratch / "out", log_path, params)
        return await self._run_oneshot(input_path, log_path, params)

    async def _run_oneshot(
        self, input_path: Path, log_path: Path, params: Mapping[str, registry.Value]
    ) -> verdict.Write | None:
        """Run the model as a process of its own in the lane; the final write to make."""
        job, spec, scratch, config = self.job, self.spec, self.lane, self._site.config
        argv = spec.build_argv(
            params, input_path=input_path, output_dir=scratch / "out", python=config.python
        )
        process = runner.ModelProcess(
            argv,
            cwd=scratch,
            env=oneshot.env(job, scratch, config.worker_id, config.database),
            log_path=log_path,
            timeout_s=spec.timeout_s,
            kill_grace_s=config.kill_grace_s,
            max_log_bytes=config.max_log_bytes,
            on_progress=self._on_progress,
        )
        try:
            pid = await process.start()
        except OSError as exc:
            never = runner.cannot_start(exc) and scratch.is_dir()  # else this host's passing trouble
            return self._verdict.failure(f"the model could not be started: {exc}", retryable=not never)
        self._process = process
        if self._stop_reason is not None:
            process.stop(self._stop_reason)
        result = await self._watch.over(pid, process.wait())
        await oneshot.kill_leftovers(job, result, config.worker_id, self._site.live_runs)
        stopped = self._stopped_by(result.stopped)
        if stopped is not None:
            return self._verdict.after_peak(self._stopped_outcome(stopped), self._watch.peak_mb)
        return self._verdict.after_peak(
            await self._verdict.of_process(result, scratch / "out", self._watch.peak_mb), self._watch.peak_mb
        )

    async def _run_warm(
        self, input_path: Path, out_dir: Path, log_path: Path, params: Mapping[str, registry.Value]
    ) -> verdict.Write | None:
        """Run the job in a warm runner of its model on its GPU: an idle one, else a new one or the
        first busy one to come free (app/warmpool.py). Stopped while it waits, it runs nothing. A
        runner found gone before it took the job (it exited, idle, as the job was sent) cost the job
        nothing: it goes to another runner, up to GONE_TRIES runners in all."""
        assert self._site.pool is not None
        job, config = self.job, self._site.config
        run = warmrun.WarmRun(
            job, self.spec, self._site.pool, self._site.store, config.worker_id, config.python,
            config.database,
        )  # fmt: skip
        request = modelkit.Request(f"{job.id}:{job.attempt}", input_path, out_dir, params)
        for _ in range(GONE_TRIES):
            ran = await self._in_a_runner(run, request, log_path)
            if not isinstance(ran, tuple) or ran[0].outcome is not warmresult.Outcome.GONE:
                break
            log.info(
                "the warm runner given the job had exited before it took it: another runner runs it",
                extra={"action": "runner_gone", "job_id": str(job.id), "attempt": job.attempt},
            )
        if not isinstance(ran, tuple):
            return ran
        result, about = ran
        stopped = self._stopped_by(result.stopped)
        if stopped is not None or result.outcome is warmresult.Outcome.STOPPED:
            return self._stopped_outcome(stopped or CANCELED)
        return await self._verdict.of_warm(result, out_dir, about, self._watch.peak_mb)

    async def _in_a_runner(
        self, run: warmrun.WarmRun, request: modelkit.Request, log_path: Path
    ) -> tuple[warmresult.WarmResult, dict[str, Any]] | verdict.Write | None:
        """The job run in one runner, with what its success event will say of that runner; or the
        write for a runner that could not be had."""
        try:
            runner = await run.acquire(give_up=self._stopped)
        except warmpool.GaveUp:
            return self._stopped_outcome(self._stop_reason or SHUTDOWN)  # or the pool closed
        except warmresult.StartFailed as exc:
            self._say(f"the warm runner did not start: {exc}", tag="warm")
            return self._verdict.not_started(exc, self._watch.peak_mb)
        except OSError as exc:  # a new runner's temporary folder (app/storage.py): this host's trouble
            why = f"could not make the runner's temporary folder: {exc}"
            self._say(why, tag="warm")
            return self._verdict.storage_failed(why)
        about = warmrun.about(runner)
        self._runner = runner
        try:
            if self._stop_reason is not None:
                runner.stop(self._stop_reason)
            result = await run.run(
                runner, request, log_path, watch=self._watch, on_progress=self._on_progress
            )
        finally:
            self._runner = None
        return result, about

    def _say(self, why: str, *, tag: str = "runner") -> None:
        """Write why the attempt ended before its model ran as the attempt's log: a failed job
        always has a log that says why; without one, its log link answered an empty log, as for a
        model that ran and said nothing."""
        said = RunLog(self._site.store.log_path(self.job.id, self.job.attempt), tag)
        said.note(why)
        said.close(keep=True)

    async def _record_pid(self, pid: int) -> None:
        """Record the pid (best effort while the database is away) and honour a pending cancel."""
        try:
            if await self._site.manager.set_pid(self.job, pid):
                self.stop(CANCELED)
        except errors.LeaseLost:
            self.stop(LEASE_LOST)
        except Exception as exc:
            if not db.is_unavailable(exc):
                self.stop(f"internal error: {exc!r}")
                raise

    def _stopped_by(self, run_stopped: str | None) -> str | None:
        """Why the run counts as stopped: the stop that ended it, or one that came after it ended
        by itself (while its last progress or pid was written), but for a shutdown: the outcome of
        a run that ended is written, not handed back to be run again."""
        if run_stopped is not None or self._stop_reason == SHUTDOWN:
            return run_stopped
        return self._stop_reason

    def _stopped_outcome(self, reason: str) -> verdict.Write | None:
        """A run stopped from outside: lost (discard), shutdown (hand back), canceled, or broken."""
        if reason == LEASE_LOST:
            log.warning(
                "lease lost; output discarded", extra={"action": "lease_lost", "job_id": str(self.job.id)}
            )
            return None
        if reason in (SHUTDOWN, PAUSED):
            return functools.partial(self._verdict.hand_back, reason)
        if reason == CANCELED:
            return self._verdict.failure("canceled while running", retryable=False)
        return self._verdict.failure(f"stopped: {reason}", retryable=True)

    def _storage_trouble(self, error: str) -> None:
        """The job's files could not be written here: the worker is told (it pauses its claims)."""
        self.storage_trouble = error
        if self._site.on_storage_trouble is not None:
            self._site.on_storage_trouble(self)

    async def _on_progress(self, fraction: float, message: str) -> None:
        """Record progress, and an event at each new quarter below 1. The feed that calls this
        (app/progress.py) hands on at most four updates a second, whatever their value, and the
        run's last one at its end, so every update that reaches here is written."""
        quarter = int(fraction * 4)
        message = verdict.storable(message[:PROGRESS_MESSAGE_CHARS])
        try:
            if await self._site.manager.progress(self.job, fraction, message):
                self.stop(CANCELED)
            if quarter > self._milestone and fraction < 1:
                self._milestone = quarter
                await self._site.manager.add_event(
                    self.job, "progress", {"progress": quarter / 4, "message": message}
                )
        except errors.LeaseLost:
            self.stop(LEASE_LOST)
        except Exception as exc:
            if not db.is_unavailable(exc):
                raise
            # Progress is best effort while the database is away; the run goes on.
