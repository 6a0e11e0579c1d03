"""A worker's storage gate: its claims pause while its storage folder cannot take a job's files."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping

from app import storage
from app.queue import attempt as attempt_

log = logging.getLogger("gpujobs.worker")

# The longest pause of claims after jobs whose files could not be written (it doubles from the poll
# interval while they go on failing so).
STORAGE_PAUSE_MAX_S = 300.0


class StorageGate:
    """Closed when a job's files could not be written (a full disk, a folder gone read-only): claims
    pause until a probe of the storage folder passes, or every job would spend its attempts here."""

    def __init__(
        self,
        store: storage.ResultStore,
        worker_id: str,
        poll_interval_s: float,
        running: Mapping[uuid.UUID, tuple[attempt_.Attempt, asyncio.Task[None]]],
        changed: Callable[[], None],
    ) -> None:
        self._store = store
        self._changed = changed  # told when `trouble` is set or cleared (the heartbeat stores it)
        self._running = running  # the worker's attempts in hand, by job
        self._worker_id = worker_id
        self._poll_interval_s = poll_interval_s
        self.trouble: str | None = None  # why the gate closed; None while it is open
        self._pause_s = 0.0  # how long claims pause before the next probe (doubles)
        self._next_probe_s = 0.0

    async def usable(self) -> bool:
        """Whether the storage folder may take jobs: after a job's files could not be written, not
        until the pause has passed and a probe (storage.ResultStore.probe) shows it takes a file."""
        if self.trouble is None:
            return True
        if time.monotonic() < self._next_probe_s:
            return False
        try:
            await asyncio.to_thread(self._store.probe, self._worker_id)
        except OSError as exc:
            self._next_probe_s = time.monotonic() + self._pause_s
            log.debug("storage folder still unusable: %s", exc, extra={"action": "storage_probe_failed"})
            return False
        self.trouble = None
        self._changed()
        log.info("storage folder usable again; claiming", extra={"action": "storage_usable_again"})
        return True

    def failed(self, run: attempt_.Attempt) -> None:
        """A job's files could not be written: claims pause, longer each time in a row (a disk with
        room for the probe but not for a job's files would otherwise spend an attempt of each job
        it claims, one pause after another)."""
        if self.trouble is not None:
            return
        self.trouble = run.storage_trouble
        self._changed()
        for other, _ in self._running.values():  # claimed ahead, or starting: they go back unrun
            if other is not run and other.model_started_s is None:
                other.stop(attempt_.PAUSED)
        pause = 2 * self._pause_s or self._poll_interval_s
        self._pause_s = min(pause, STORAGE_PAUSE_MAX_S)
        self._next_probe_s = time.monotonic() + self._pause_s
        log.warning(
            "%s; claiming nothing until the storage folder takes a file again (checked in %g s)",
            run.storage_trouble,
            self._pause_s,
            extra={"action": "storage_unusable", "job_id": str(run.job.id)},
        )

    def written(self) -> None:
        """A job's files were written: a new trouble pauses briefly again (unless one is on now)."""
        if self.trouble is None:
            self._pause_s = 0.0
