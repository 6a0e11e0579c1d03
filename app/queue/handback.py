"""A worker's hand-back: its jobs given back to the queue, no attempt spent. Those a claim that
failed with the database may have taken, and, when the worker stops at once, all those running
under its name."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection

from app import db, storage
from app.queue import manager as manager_
from app.queue import reaper
from app.queue.jobs import JobState

log = logging.getLogger("gpujobs.worker")

# Stopped at once, its models dead: how long the database has to take its jobs back, unspent, and
# then how long the statement has to give up. Past that they are left to its restart or their leases:
# the stop must not wait on a database that does not answer.
STOP_NOW_HAND_BACK_S = 1.5
STOP_NOW_GIVE_UP_S = 0.5
STOPPED_NOW = "worker stopped at once"  # the reason its jobs' `released` events give


class HandBack:
    """One worker's hand-back of its jobs: what a lost claim took, when the claims, the reaper or the
    shutdown come to it; all the worker runs, when the worker says (its stop at once)."""

    def __init__(
        self,
        manager: manager_.JobManager,
        store: storage.ResultStore,
        worker_id: str,
        running: Collection[uuid.UUID],
    ) -> None:
        self._manager = manager
        self._store = store
        self._worker_id = worker_id
        self._running = running  # the jobs of the worker's attempts in hand
        self.claim_unsure = False  # a claim failed with the database: it may have taken jobs
        # Held while claiming and starting what was claimed, and while handing back what a lost
        # claim took: that compares the jobs running under this worker's name with `running`.
        self.claiming = asyncio.Lock()

    async def release_unknown(self) -> None:
        """After a claim that failed with the database: it may have committed, its jobs running
        here under this worker's name unknown to it. They go back to the queue, unspent. (Under
        `claiming`, or with no claim left to make.)"""
        released = await self._manager.fleet.release_unknown(
            worker_id=self._worker_id, in_hand=list(self._running)
        )
        for job in released:
            log.warning(
                "handed back a job whose claim's answer was lost",
                extra={"action": "job_released", "job_id": str(job.id)},
            )
        await reaper.drop_dead_attempts(self._store, released)  # a job canceled meanwhile ended here
        self.claim_unsure = False

    async def try_release_unknown(self) -> bool:
        """`release_unknown`, once, in burst mode before it ends; whether the database answered."""
        try:
            async with self.claiming:
                await self.release_unknown()
        except Exception as exc:
            if not db.is_unavailable(exc):
                raise
            return False
        return True

    async def release_lost_claim(self) -> None:
        """`release_unknown` for the reaper's round (Reaper.reap says why); not while a claim is
        under way: that does so first."""
        if self.claim_unsure and not self.claiming.locked():
            async with self.claiming:
                if self.claim_unsure:
                    await self.release_unknown()

    async def release_stopped(self, left: list[str]) -> None:
        """The jobs running under this worker's name (those in hand, `left`, and any a claim cut
        short took) go back to the queue, unspent, or end canceled when a cancel is pending; if the
        database has not done so within STOP_NOW_HAND_BACK_S, the statement is given up and the
        jobs are left running under its name, as the line logged says."""
        release = asyncio.create_task(
            self._manager.fleet.release_stopped(worker_id=self._worker_id, reason=STOPPED_NOW),
            name=f"hand-back:{self._worker_id}",
        )
        await asyncio.wait([release], timeout=STOP_NOW_HAND_BACK_S)
        if not release.done():
            release.cancel()
            await asyncio.wait([release], timeout=STOP_NOW_GIVE_UP_S)
        if release.done() and not release.cancelled() and release.exception() is None:
            for job in release.result():
                canceled = job.state is JobState.canceled  # its cancel was pending
                extra = {"action": "job_canceled" if canceled else "job_released", "job_id": str(job.id)}
                log.info(
                    "job %s: worker stopped at once", "canceled" if canceled else "handed back", extra=extra
                )
            # A job canceled here ended: its folders go.
            await reaper.drop_dead_attempts(self._store, release.result())
            return
        why = f"the database did not answer within {STOP_NOW_HAND_BACK_S:g} s"
        if release.done() and not release.cancelled():
            why = f"the database failed: {release.exception()!r}"
        log.warning(
            "%s: %d jobs left running under its name, for its restart to take back at once, else another "
            "worker after their leases: %s",
            why,
            len(left),
            ", ".join(left) or "none",
            extra={"action": "jobs_left", "worker": self._worker_id},
        )
