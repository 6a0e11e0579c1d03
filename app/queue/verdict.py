"""The verdict of an attempt's run: what ended it, in words, its retry delay, and the final write
that records it.

Every write here is fenced by (job id, attempt): one that finds the job gone (lease expired and
taken back, canceled, or a newer attempt) raises LeaseLost, and `persist_or_fail` drops it. A final
write is a callable, so that a database outage is ridden out by making it again, whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeAlias

from app import db, errors, registry, runner, scheduler, storage, warmresult
from app.queue import manager as manager_
from app.queue.jobs import Job, JobState, ResultFile

log = logging.getLogger("gpujobs.worker")

Write: TypeAlias = Callable[[], Awaitable[Any]]  # a final write, made again whole after an outage

# A job whose files this host could not write goes back to the queue with this reason, no attempt
# spent, at most STORAGE_RETURNS_MAX times: one whose own outputs fill any disk must end, not go
# round the workers for ever, pausing the claims of each (its later tries spend attempts).
STORAGE = "storage unusable"
STORAGE_RETURNS_MAX = 3
# Outputs up to this size are hashed on the event loop (about a millisecond); larger ones in a thread.
_HASH_ON_LOOP_BYTES = 1 << 20


def retry_delay_s(failure: int, base_s: float, max_s: float) -> float:
    """Exponential backoff with jitter: about base * 2^(failure-1), between half and all of it."""
    ceiling = min(max_s, base_s * 2 ** max(failure - 1, 0))
    return random.uniform(ceiling / 2, ceiling)


def failures_counted(job: Job, budget: int) -> int:
    """Which failure of its attempt budget (the model's max_attempts) the job's running attempt is,
    if it fails now: 1 for the first. Runs handed back unspent (a graceful stop, storage trouble,
    an out-of-memory retry) and an admin retry move `max_attempts` up instead of counting, so
    they must not double the delay either: after six rolling restarts, a job's first failure
    waited 64 times the first delay."""
    return max(1, budget - (job.max_attempts - job.attempt))


# The most of a model's words an error keeps (a warm runner's error, which the runner writes as it
# likes: app/modelkit.py cuts its own at the same length). A 900 KiB error made the job's JSON 900
# KB, and its history twice that. A one-shot run's error quotes its log's tail (runlog.TAIL_BYTES).
ERROR_CHARS = 8192


def storable(text: str) -> str:
    """A model's words as PostgreSQL can store them: a NUL (which no text column nor jsonb takes,
    and which failed the whole final write) becomes U+FFFD; cut to ERROR_CHARS, saying so."""
    if len(text) > ERROR_CHARS:
        text = f"{text[:ERROR_CHARS]}\n[cut: {len(text):,} characters in all]"
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


class Verdict:
    """The final writes one attempt may make, for a run that was not stopped from outside (the
    attempt judges a stop itself: app/queue/attempt.py)."""

    def __init__(
        self,
        job: Job,
        spec: registry.ModelSpec,
        *,
        manager: manager_.JobManager,
        store: storage.ResultStore,
        worker_id: str,
        retry_base_s: float,
        retry_max_s: float,
        oom_max_retries: int,
        oom_growth: float,
        capacity_mb: int,
        on_storage_trouble: Callable[[str], None],
    ) -> None:
        self._job, self._spec, self._manager, self._store = job, spec, manager, store
        self._worker_id = worker_id  # whose probe file tries the storage folder
        self._retry_base_s, self._retry_max_s = retry_base_s, retry_max_s
        self._oom_max_retries, self._oom_growth = oom_max_retries, oom_growth
        self._capacity_mb = capacity_mb  # the largest GPU less the buffer: the most an estimate may grow to
        self._on_storage_trouble = on_storage_trouble

    async def of_process(self, result: runner.RunResult, out_dir: Path, peak_mb: int | None) -> Write:
        """The final write for a one-shot run that ended by itself (or at its timeout)."""
        spec = self._spec
        if result.ok:
            return self.success(out_dir, result.duration_s, said=result.log_tail)
        if not result.timed_out and (trouble := await self.disk_trouble(result.log_tail)) is not None:
            return self.storage_failed(trouble)
        if not result.timed_out and spec.out_of_memory(result.exit_code, result.log_tail):
            return self.out_of_memory(describe(result, spec.timeout_s), peak_mb)
        # A model stopped at its timeout may answer SIGTERM with any code: it stays a timeout.
        bad_input = not result.timed_out and result.exit_code in spec.bad_input_exit_codes
        error = describe(result, spec.timeout_s)
        return self.failure(
            ("bad input: " if bad_input else "") + error,
            retryable=not bad_input,
            exit_code=result.exit_code,
            signal=result.signal,
            timed_out=result.timed_out,
            abnormal=result.signal is not None and not result.timed_out,  # a signal we did not send
        )

    async def of_warm(
        self, result: warmresult.WarmResult, out_dir: Path, about: Mapping[str, Any], peak_mb: int | None
    ) -> Write:
        """The final write for a job run in a warm runner, not stopped."""
        if result.outcome in (warmresult.Outcome.FAILED, warmresult.Outcome.CRASHED, warmresult.Outcome.GONE):
            # (A runner that broke the protocol is not asked: its words are not to be trusted.)
            # The error last: its line, the model's own words, is the one quoted (the last found).
            trouble = await self.disk_trouble(result.log_tail, result.error or "")
            if trouble is not None:
                return self.storage_failed(trouble)
        error = result.error or "(no message)"
        match result.outcome:
            case warmresult.Outcome.DONE:
                return self.success(out_dir, result.duration_s, about, said=result.log_tail)
            case warmresult.Outcome.BAD_INPUT:
                return self.failure(f"bad input: {error}", retryable=False)
            case warmresult.Outcome.OOM:
                return self.out_of_memory(error, peak_mb)
            case warmresult.Outcome.TIMED_OUT:
                return self.failure(
                    f"timed out after {self._spec.timeout_s:g} s", retryable=True, timed_out=True
                )
            case warmresult.Outcome.BROKE:  # a model's bug, as an error is: not an abnormal death
                return self.failure(f"the warm runner broke the protocol: {error}", retryable=True)
            case warmresult.Outcome.CRASHED | warmresult.Outcome.GONE:
                return self.failure(
                    f"the warm runner died: {error}\n{result.log_tail}".strip(),
                    retryable=True,
                    exit_code=result.exit_code,
                    signal=result.signal,
                    abnormal=True,
                )
            case _:
                return self.failure(f"the model failed: {error}", retryable=True)

    def not_started(self, exc: warmresult.StartFailed, peak_mb: int | None) -> Write:
        """The final write for a warm runner that did not start for the job."""
        if self._spec.out_of_memory(exc.exit_code, str(exc)):
            return self.out_of_memory(f"the warm runner did not load: {exc}", peak_mb)
        # As for a one-shot run: a missing program fails at once; a failed load is retried.
        return self.failure(f"the warm runner did not start: {exc}", retryable=not exc.permanent)

    async def disk_trouble(self, *said: str) -> str | None:
        """Why a run that failed by itself failed for this host's storage, not for the job (None:
        nothing says so): what it said last names a full disk (ENOSPC, EDQUOT), or the storage
        folder no longer takes the probe's file (storage.ResultStore.probe), the run's partial
        outputs still in its lane. (A model that died writing its outputs to a full disk was
        counted as failing: the job spent an attempt, and the worker went on claiming.)"""
        line = storage.full_disk_line("\n".join(said))
        if line is not None:
            return f"the model ran out of disk space: {line}"
        try:
            await asyncio.to_thread(self._store.probe, self._worker_id)
        except OSError as exc:
            return f"the storage folder takes no file after the run: {exc}"
        return None

    def after_peak(self, write: Write | None, peak_mb: int | None) -> Write | None:
        """`write` (the final write), preceded by the run's peak GPU memory, if NVML showed one: one
        write, which `persist_or_fail` retries whole through a database outage. The peak goes first,
        while the job is still running (the statement is fenced on that). Written apart, before, an
        outage took it for one before the model ran, and the outcome was never written."""
        if not peak_mb or write is None:
            return write

        async def peak_then_write() -> Any:
            with contextlib.suppress(errors.LeaseLost):  # the outcome's own write meets it too
                await self._manager.record_peak(self._job, peak_mb)
            return await write()

        return peak_then_write

    async def hand_back(self, reason: str) -> None:
        """The worker is stopping, or pausing its claims: the job goes back to the queue, no
        attempt spent."""
        if await self._unless_canceled(self._manager.release(self._job, reason=reason)):
            extra = {"action": "job_released", "job_id": str(self._job.id)}
            log.info("job handed back: %s", reason, extra=extra)

    def out_of_memory(self, what: str, peak_mb: int | None) -> Write:
        """Queue again with a larger estimate (no attempt spent), or fail once that cannot help."""
        job = self._job
        grown = scheduler.after_oom_mb(
            job.vram_mb, peak_mb, growth=self._oom_growth, capacity_mb=self._capacity_mb
        )
        error = "out of GPU memory: " + storable(what)
        if job.oom_retries >= self._oom_max_retries or grown <= job.vram_mb:
            why = f"{job.oom_retries} larger retries" if grown > job.vram_mb else "the whole GPU"
            return self.failure(f"{error}\n(still out of memory with {why})", retryable=False)
        detail = {
            "vram_mb": job.vram_mb,
            "new_vram_mb": grown,
            "peak_mb": peak_mb,
            "oom_retry": job.oom_retries + 1,
        }

        async def write() -> None:
            if await self._unless_canceled(
                self._manager.requeue_oom(job, vram_mb=grown, error=error, detail=detail)
            ):
                extra = {"action": "job_queued", "job_id": str(job.id), "vram_mb": grown}
                log.info("job queued again with more GPU memory, no attempt spent", extra=extra)

        return write

    async def _unless_canceled(self, requeue: Awaitable[None]) -> bool:
        """Queue the job again without spending an attempt (a hand-back, an out-of-memory retry);
        whether it was. Those statements refuse a job whose cancel is pending: it ends canceled
        instead, now, not after its lease runs out. A job truly lost is refused by that write too
        (LeaseLost)."""
        try:
            await requeue
        except errors.LeaseLost:
            await self.failure("canceled while running", retryable=False)()
            return False
        return True

    def storage_failed(self, error: str) -> Write:
        """The final write for files this host could not write (a full disk, a folder gone
        read-only), which the worker is told of (it pauses its claims): the job goes back to the
        queue, no attempt spent, as the host's trouble is not the job's; past STORAGE_RETURNS_MAX
        returns, the attempt fails, to be retried."""
        self._on_storage_trouble(error)
        failure = self.failure(error, retryable=True)

        async def write() -> None:
            try:
                back = await self._manager.release_storage(
                    self._job, reason=STORAGE, error=storable(error), most=STORAGE_RETURNS_MAX
                )
            except errors.LeaseLost:  # its cancel is pending (a job truly lost meets that write too)
                await self.failure("canceled while running", retryable=False)()
                return
            if not back:
                await failure()
                return
            extra = {"action": "job_released", "job_id": str(self._job.id)}
            log.info("job handed back, no attempt spent: %s", error.splitlines()[0], extra=extra)

        return write

    def failure(self, error: str, *, retryable: bool, **detail: Any) -> Write:
        """The final write of a failed attempt: retried after a backoff, or failed for good."""
        job = self._job
        delay = retry_delay_s(
            failures_counted(job, self._spec.max_attempts), self._retry_base_s, self._retry_max_s
        )
        abnormal, error = bool(detail.pop("abnormal", False)), storable(error)
        detail = {"error": error.splitlines()[0], "retryable": retryable, **detail}

        async def write() -> None:
            state = await self._manager.fail(
                job, error=error, retryable=retryable, delay_s=delay, detail=detail, abnormal=abnormal
            )
            if state.final and job.attempt > 1:  # an earlier attempt's worker may have died storing
                await asyncio.to_thread(self._store.drop_attempts, job.id, upto=job.attempt)
            log.info("job %s", state, extra={"action": f"job_{state}", "job_id": str(job.id)})

        return write

    def success(
        self, out_dir: Path, duration_s: float, about: Mapping[str, Any] | None = None, *, said: str = ""
    ) -> Write:
        """The final write of a run whose model succeeded: its outputs checked, published, and the
        job marked succeeded; `about` goes into the event's detail beside `duration_s`, `said` is
        the run's last lines (read for a full disk when an output is missing or empty)."""
        expected = [
            storage.ExpectedOutput(name, media_type, spec.required, spec.max_mb * 1024 * 1024)
            for name, media_type, spec in self._spec.expected_outputs(self._job.params)
        ]
        job = self._job
        published = unsure = False
        files: list[ResultFile] | None = None

        async def write() -> None:
            # Check and publish once; a retry after a database outage repeats only the database write.
            nonlocal published, unsure, files
            if files is None and (files := await self._checked(out_dir, expected, said)) is None:
                return
            if not published and files and not await self._published(files):
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

    async def _checked(
        self, out_dir: Path, expected: list[storage.ExpectedOutput], said: str
    ) -> list[ResultFile] | None:
        """A successful run's outputs, checked and hashed; None when they could not be, the outcome
        that means (a bad output, this host's storage trouble, an unreadable file) written instead.
        An output missing or empty while the disk was full (the run's log could not be written,
        its last lines name a full disk, or the storage folder takes no file now) is the host's
        trouble: a model that exits 0 without checking its writes leaves just that."""
        try:
            return await self._checked_outputs(out_dir, expected)
        except storage.OutputMissing as exc:
            if (trouble := await self.disk_trouble(said)) is not None:
                await self.storage_failed(f"{trouble}; {exc.message}")()
            else:
                await self.failure(f"bad output: {exc.message}", retryable=False)()
        except storage.OutputInvalid as exc:
            await self.failure(f"bad output: {exc.message}", retryable=False)()
        except errors.StorageError as exc:  # its cause, an OSError, reads as a database outage
            await self._store_failed(exc)
        except OSError as exc:  # as in Attempt._run_model: not to be taken for a database outage
            await self.failure(f"could not read the outputs: {exc}", retryable=True)()
        return None

    async def _published(self, files: list[ResultFile]) -> bool:
        """Publish the checked outputs; False when this host could not, its storage failure written."""
        job = self._job
        try:  # in a thread: its fsyncs may take a while on a busy disk
            await asyncio.to_thread(self._store.publish, job.id, job.attempt, files)
        except errors.StorageError as exc:  # its cause, an OSError, reads as a database outage
            await self._store_failed(exc)
            return False
        return True

    async def _store_failed(self, exc: errors.StorageError) -> None:
        """This host's storage failed the results; LeaseLost if the job is no longer this attempt's:
        a newer attempt's success removes the files of the attempts before it (this one's too, when
        its worker was paused while it stored them), which is no trouble of the host's."""
        now = await self._manager.get(self._job.id)
        if (now.state, now.attempt) != (JobState.running, self._job.attempt):
            raise errors.LeaseLost(f"attempt {self._job.attempt} of job {self._job.id} is no longer running")
        await self.storage_failed(f"could not store the results: {exc.__cause__ or exc}")()

    async def _checked_outputs(
        self, out_dir: Path, expected: list[storage.ExpectedOutput]
    ) -> list[ResultFile]:
        """The outputs moved out of the lane into the attempt's staging folder, checked there
        (store.stage) and hashed; the hashing, which reads every output whole, in a thread once
        they are large, so the worker's loop (its heartbeats, the other jobs' pipes, the API under
        `serve`) goes on. Hashed in the lane, an output could be replaced by path (by a process the
        run left behind) between its hash and its publishing."""
        job = self._job
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
        now = await self._manager.get(self._job.id)
        return now.state is JobState.succeeded and now.attempt == self._job.attempt

    async def persist_or_fail(self, write: Write) -> None:
        """The final write; one that PostgreSQL refuses (not an outage) is replaced by a plain
        failure, to be retried. Else the job would stay running, with no error, until its lease ran
        out, and come back as a lost worker's (abnormal, counted towards quarantine)."""
        try:
            await self._persist(write)
        except Exception as exc:
            log.exception(
                "the outcome could not be written; failing the attempt instead",
                extra={"action": "outcome_refused", "job_id": str(self._job.id)},
            )
            refused = f"internal error in the worker: its outcome could not be written ({type(exc).__name__})"
            await self._persist(self.failure(refused, retryable=True))

    async def _persist(self, write: Write) -> None:
        """Make the final write, riding out a database outage; fencing decides if it still counts."""
        delay = 0.2
        while True:
            try:
                await write()
                return
            except errors.LeaseLost:
                log.warning(
                    "job lost before its result was written",
                    extra={"action": "lease_lost", "job_id": str(self._job.id)},
                )
                return
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
                log.warning("database unavailable; will retry the final write", extra={"action": "db_retry"})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
