"""RunLog: a run's log file is made at the model's first byte; the worker's lines wait for it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.runlog import TAIL_BYTES, RunLog


def test_a_quiet_run_makes_no_file_but_keeps_its_lines_in_the_tail(tmp_path: Path) -> None:
    log = RunLog(tmp_path / "logs" / "run.log", "runner")
    log.note("started pid 7")
    log.note("exit code 0")
    log.close()
    assert not (tmp_path / "logs").exists()
    assert log.tail() == "[runner] started pid 7\n[runner] exit code 0"


def test_the_first_output_writes_the_waiting_lines_first(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "run.log"
    log = RunLog(path, "warm")
    log.note("job sent")
    log.write(b"")  # nothing said yet: still no file
    assert not path.exists()
    log.write(b"loading weights\n")
    log.note("done after 0.10 s")
    log.close()
    log.write(b"late\n")  # after close: the tail only
    assert path.read_text() == "[warm] job sent\nloading weights\n[warm] done after 0.10 s\n"
    assert log.tail().endswith("late")


def test_a_run_that_ended_badly_keeps_its_lines_though_the_model_said_nothing(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    log = RunLog(path, "runner")
    log.note("timed out after 1s")
    log.close(keep=True)
    assert path.read_text() == "[runner] timed out after 1s\n"


def test_an_eager_log_is_made_at_once_and_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "runner.log"
    path.write_text("an earlier life\n")
    log = RunLog(path, "warm", eager=True)
    log.note("started")
    log.close()
    assert path.read_text() == "an earlier life\n[warm] started\n"


def test_a_log_that_cannot_be_made_loses_nothing_from_the_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "logs").write_text("a file where the folder should be")
    log = RunLog(tmp_path / "logs" / "run.log", "runner")
    log.note("started")
    with caplog.at_level(logging.ERROR, logger="gpujobs.runlog"):
        log.write(b"output\n")
        log.write(b"more\n")
    log.close(keep=True)
    assert log.tail() == "[runner] started\noutput\nmore"
    assert [r.action for r in caplog.records] == ["log_write_failed"]  # said once, not per write


def test_the_tail_stays_bounded(tmp_path: Path) -> None:
    log = RunLog(tmp_path / "run.log", "runner")
    for i in range(2000):
        log.write(f"line {i}\n".encode())
    log.close()
    assert len(log.tail()) <= TAIL_BYTES and log.tail().endswith("line 1999")
