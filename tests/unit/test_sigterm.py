"""`sigterm.interrupts_held`: a step that must not be cut in two goes on through one interrupt."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from app import sigterm


@contextlib.contextmanager
def handler_for(signum: int, handler: object) -> Iterator[None]:
    previous = signal.signal(signum, handler)  # type: ignore[arg-type]
    try:
        yield
    finally:
        signal.signal(signum, previous)


def test_the_first_interrupt_is_held_and_said_and_another_goes_where_it_went(capfd):
    seen: list[int] = []

    def mine(signum: int, _frame: object) -> None:
        seen.append(signum)

    with handler_for(signal.SIGINT, mine), handler_for(signal.SIGTERM, mine):
        with sigterm.interrupts_held("carrying on", "given up") as held:
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [] and held() == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGINT)
            assert seen == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGINT, signal.SIGTERM]
    assert capfd.readouterr().err.splitlines() == ["SIGTERM: carrying on", "SIGINT: given up"]


def test_nothing_held_when_nothing_came(capfd):
    with sigterm.interrupts_held("carrying on", "given up") as held:
        pass
    assert held() is None and capfd.readouterr().err == ""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_interrupt_stays_ignored(capfd):
    with handler_for(signal.SIGINT, signal.SIG_IGN):
        with sigterm.interrupts_held("carrying on", "given up") as held:
            os.kill(os.getpid(), signal.SIGINT)
        assert held() is None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert capfd.readouterr().err == ""
