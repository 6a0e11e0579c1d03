"""How one job in a warm runner ended (app/warm.py): its Outcome, the WarmResult the runner returns,
and the judging of the runner's word: a job's final reply (or why none came), and what came
instead of the ready line of a runner that did not start."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias

from app import modelkit

Event: TypeAlias = modelkit.Reply | str | None  # a reply, a protocol violation, or EOF
EXITED_LOADING = "exited while loading"
EXITED_DURING = "the runner exited during the job"
GONE_BEFORE = "the runner had exited, idle, before it took the job"
CLOSED_STDOUT = "the runner closed its stdout during the job, and did not exit until the worker ended it"


class StartFailed(Exception):
    """The runner could not start, or exited, timed out, was stopped or broke the protocol first.
    `permanent`: its program is missing or not executable, which no retry mends. `exit_code`: what
    it exited with when it exited by itself while loading (for the model's oom_exit_codes)."""

    def __init__(self, message: str, *, permanent: bool = False, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.permanent, self.exit_code = permanent, exit_code


class Outcome(StrEnum):
    """How one job in a warm runner ended."""

    DONE = "done"
    FAILED = "failed"  # the model raised (the runner was ended)
    BAD_INPUT = "bad_input"
    OOM = "oom"
    CRASHED = "crashed"  # the runner died
    BROKE = "broke"  # the runner broke the protocol (and was ended): the model's fault, not a death
    GONE = "gone"  # an idle runner had exited on its own before it took the job: nothing ran it
    TIMED_OUT = "timed_out"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class WarmResult:
    """How one job ended; for CRASHED, the runner's exit code or signal too."""

    outcome: Outcome
    error: str | None
    outputs: tuple[str, ...]
    stopped: str | None  # the reason given to stop()
    exit_code: int | None
    signal: int | None
    duration_s: float
    log_tail: str  # the last lines of this job's log

    @property
    def ok(self) -> bool:
        """Whether the job succeeded."""
        return self.outcome is Outcome.DONE

    @classmethod
    def of(
        cls, judged: Judged, *, stop_reason: str | None, returncode: int | None, took_s: float, log_tail: str
    ) -> WarmResult:
        """A job's end as `judge` found it; the runner's `returncode` counts for CRASHED only (any
        other end that killed the runner was its own kill), the `stop_reason` for STOPPED only."""
        outcome, error, outputs = judged
        code = returncode if outcome is Outcome.CRASHED else None
        exit_code, sig = (code, None) if code is None or code >= 0 else (None, -code)
        stopped = stop_reason if outcome is Outcome.STOPPED else None
        return cls(outcome, error, outputs, stopped, exit_code, sig, took_s, log_tail)


# A job's outcome, the error it reports (None for DONE), and the outputs the model named.
Judged: TypeAlias = tuple[Outcome, str | None, tuple[str, ...]]


def judge(event: Event | Outcome, job: str, *, stop_reason: str | None, timeout_s: float) -> Judged:
    """The outcome a job's final event means, or its absence (Outcome.STOPPED: stop() came first,
    for `stop_reason`; Outcome.TIMED_OUT: the deadline)."""
    if event is Outcome.STOPPED:
        return event, stop_reason, ()
    if event is Outcome.TIMED_OUT:
        return event, f"timed out after {timeout_s:g} s", ()
    if event is None:
        return Outcome.CRASHED, EXITED_DURING, ()
    if isinstance(event, str):
        return Outcome.BROKE, f"protocol error: {event}", ()
    if isinstance(event, modelkit.Failed) and event.protocol:
        return Outcome.BROKE, f"protocol error: the runner rejected the job line: {event.error}", ()
    if isinstance(event, modelkit.Ready) or event.job != job:
        return Outcome.BROKE, f"protocol error: unexpected {event!r}", ()
    if isinstance(event, modelkit.Done):
        return Outcome.DONE, None, event.outputs
    assert isinstance(event, modelkit.Failed)
    outcome = Outcome.OOM if event.oom else Outcome.BAD_INPUT if event.bad_input else Outcome.FAILED
    return outcome, event.error, ()


def not_ready(event: Event | Outcome, load_timeout_s: float, stop_reason: str | None) -> str:
    """What a starting runner said instead of its ready line, or why it said nothing, in words."""
    if event is Outcome.TIMED_OUT:
        return f"not ready after {load_timeout_s:g} s"
    if event is Outcome.STOPPED:
        return f"stopped while loading: {stop_reason}"
    return EXITED_LOADING if event is None else f"protocol error before ready: {event}"
