"""SIGTERM as an exit through Python, so that `finally` blocks run: the embedded PostgreSQL a
command started is stopped, a half-downloaded file is removed."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Make SIGTERM end the process through Python (SystemExit 143), so `finally` blocks run; and
    SIGHUP (the terminal that ran `make run` closed, which killed the process outright) a SIGTERM.

    uvicorn shuts down gracefully on SIGTERM, then restores the handler it found and raises the
    signal again; with the default handler the process died right there, and the embedded
    PostgreSQL it had started kept running (`docker stop`, systemd and `kill` all send SIGTERM)."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    def as_sigterm(_signum: int, _frame: object) -> None:  # the terminal closed: stop as on SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, leave), signal.signal(signal.SIGHUP, as_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGHUP, previous[1])
