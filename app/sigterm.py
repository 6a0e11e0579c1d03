"""SIGTERM as an exit through Python, so that `finally` blocks run: the embedded PostgreSQL a
command started is stopped, a half-downloaded file is removed. And interrupts held off for a step
that must not be cut in two."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any


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


@contextlib.contextmanager
def interrupts_held(first: str, second: str) -> Iterator[Callable[[], int | None]]:
    """Hold off SIGINT and SIGTERM while a step that must not be cut in two runs (a key stored and
    not yet shown). The first one is noted, and `first` is said on stderr after its name; the step
    goes on. Another one is said with `second` and handled as it would have been. Yields a function
    that tells which signal was held (None for none), so the caller can end by it afterwards."""
    held: list[int] = []
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def hold(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not held:
            held.append(signum)
            _say(f"{name}: {first}\n")
            return
        _say(f"{name}: {second}\n")
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        else:  # the default action: restored, and the signal sent again
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # An ignored signal stays so; None: a handler not set from Python, which cannot be put back.
    taken = [s for s, handler in previous.items() if handler not in (signal.SIG_IGN, None)]
    for s in taken:
        signal.signal(s, hold)
    try:
        yield lambda: held[0] if held else None
    finally:
        for s in taken:
            signal.signal(s, previous[s])


def _say(line: str) -> None:
    """Write `line` on stderr from a signal handler: straight to its file descriptor, since the
    handler may run inside a write to sys.stderr (a second signal during the first one's message:
    "reentrant call inside <_io.BufferedWriter name='<stderr>'>")."""
    os.write(2, line.encode(errors="replace"))
