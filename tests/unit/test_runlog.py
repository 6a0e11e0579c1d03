"""RunLog: a run's log file is made at the model's first byte; the worker's lines wait for it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.runlog import TAIL_BYTES, TAIL_LINES, RunLog


def test_a_quiet_run_makes_no_file_but_keeps_its_lines_in_the_tail(tmp_path: Path) -> None:
    log = RunLog(tmp_path / "logs" / "run.log", "runner")
    log.note("started pid 7")
    log.note("exit code 0")
    log.close()
    assert not (tmp_path / "logs").exists()
    assert log.tail() == "[runner] started pid 7\n[runner] exit code 0"


def test_a_command_line_goes_to_the_file_but_not_to_the_tail_a_run_is_judged_by(tmp_path: Path) -> None:
    """The command line holds the request's params: a label saying "No space left on device" in
    the tail made a bad input pass for the host's full disk (app/queue/verdict.py)."""
    path = tmp_path / "run.log"
    log = RunLog(path, "runner")
    log.note("started pid 7", command="model --label No space left on device")
    log.write(b"bad image\n")
    log.close()
    assert log.tail() == "[runner] started pid 7\nbad image"
    assert path.read_text() == "[runner] started pid 7: model --label No space left on device\nbad image\n"


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


def run_stream(log: RunLog, lines: int = 5000) -> bytes:
    """Feed `log` a run: the worker's start line, numbered lines of output, its exit line; return
    every byte of it, in order."""
    log.note("started pid 7")
    output = [f"line {i:05d}\n".encode() for i in range(lines)]
    for line in output:
        log.write(line)
    log.note("exit code 0")
    return b"[runner] started pid 7\n" + b"".join(output) + b"[runner] exit code 0\n"


def last_lines(stream: bytes) -> bytes:
    """What a capped log ends with: the last TAIL_LINES whole lines within the last TAIL_BYTES."""
    chunk = stream[-TAIL_BYTES:]
    return b"".join(chunk[chunk.find(b"\n") + 1 :].splitlines(keepends=True)[-TAIL_LINES:])


def test_a_log_past_its_cap_keeps_its_head_then_says_what_was_left_out_then_its_last_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.log"
    log = RunLog(path, "runner", max_bytes=1000)
    stream = run_stream(log)
    log.close()
    head = stream[: stream.rfind(b"\n", 0, 1000) + 1]  # whole lines, up to the cap
    end = last_lines(stream)
    assert end.endswith(b"line 04999\n[runner] exit code 0\n") and len(end.splitlines()) == TAIL_LINES
    left_out = len(stream) - len(head) - len(end)
    marker = f"[runner] log cap of 1000 bytes reached: {left_out} bytes left out; the last lines follow\n"
    assert path.read_bytes() == head + marker.encode() + end
    assert path.stat().st_size < 1000 + len(marker) + TAIL_BYTES


def test_a_capped_log_keeps_the_same_tail_in_memory(tmp_path: Path) -> None:
    capped = RunLog(tmp_path / "a.log", "runner", max_bytes=1000)
    uncapped = RunLog(tmp_path / "b.log", "runner")
    run_stream(capped)
    run_stream(uncapped)
    capped.close()
    uncapped.close()
    capped.write(b"late\n")
    uncapped.write(b"late\n")
    assert capped.tail() == uncapped.tail() and capped.tail().endswith("[runner] exit code 0\nlate")


def test_a_log_within_its_cap_is_what_it_was_without_one(tmp_path: Path) -> None:
    measure = RunLog(tmp_path / "measure.log", "runner")
    stream = run_stream(measure, lines=100)
    measure.close()
    for cap in (0, len(stream), len(stream) + 1):
        path = tmp_path / f"cap-{cap}.log"
        log = RunLog(path, "runner", max_bytes=cap)
        run_stream(log, lines=100)
        log.close()
        assert path.read_bytes() == stream


def test_no_cap_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    log = RunLog(path, "runner", max_bytes=0)
    stream = run_stream(log, lines=50_000)
    log.close()
    assert path.read_bytes() == stream


def test_a_line_longer_than_the_cap_is_cut_at_the_cap(tmp_path: Path) -> None:
    """A progress bar redrawn with carriage returns has no newline: the head is cut at the cap."""
    path = tmp_path / "run.log"
    log = RunLog(path, "runner", max_bytes=5000)
    bar = b"".join(b"\r%3d%% |" % (i % 100) + b"#" * 50 for i in range(2000))
    log.write(bar)
    log.close()
    text = path.read_bytes()
    assert text.startswith(bar[:5000] + b"\n[runner] log cap of 5000 bytes reached: ")
    assert text.endswith(bar[-TAIL_BYTES:])  # no newline in the tail either: its last TAIL_BYTES


def test_a_log_just_past_its_cap_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    log = RunLog(path, "runner", max_bytes=30)
    log.write(b"first line\nsecond line\nthird line\n")
    log.close()
    assert path.read_bytes() == (
        b"first line\nsecond line\n"
        b"[runner] log cap of 30 bytes reached: 0 bytes left out; the last lines follow\n"
        b"third line\n"
    )


def test_a_rotating_log_moves_a_full_file_aside_and_goes_on_in_a_fresh_one(tmp_path: Path) -> None:
    path = tmp_path / "runner.log"
    path.with_name("runner.log.1").write_text("an old rotation\n")
    log = RunLog(path, "warm", eager=True, max_bytes=1000, rotate=True)
    lines = [f"stderr line {i:04d}\n".encode() for i in range(500)]  # 18 bytes each
    for line in lines:
        log.write(line)
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runner.log", "runner.log.1"]
    older, newer = path.with_name("runner.log.1").read_bytes(), path.read_bytes()
    assert 1000 - 18 < len(older) <= 1000 and 0 < len(newer) <= 1000  # whole lines in each
    assert (older + newer) == b"".join(lines)[-len(older + newer) :]
    assert log.tail().endswith("stderr line 0499")


def test_a_rotating_log_already_over_its_cap_rotates_at_the_first_write(tmp_path: Path) -> None:
    path = tmp_path / "runner.log"
    path.write_bytes(b"x" * 2000 + b"\n")  # an earlier runner's, or a cap since lowered
    log = RunLog(path, "warm", eager=True, max_bytes=1000, rotate=True)
    log.note("started")
    log.close()
    assert path.read_text() == "[warm] started\n"
    assert path.with_name("runner.log.1").read_bytes() == b"x" * 2000 + b"\n"


def test_two_runners_sharing_a_rotating_log_keep_two_files_within_the_cap(tmp_path: Path) -> None:
    """Two runners of one model on one GPU write the same runner.log: one rotates it, the other
    follows into the fresh file rather than rotating again."""
    path = tmp_path / "runner.log"
    first = RunLog(path, "warm", eager=True, max_bytes=1000, rotate=True)
    second = RunLog(path, "warm", eager=True, max_bytes=1000, rotate=True)
    for i in range(300):
        (first if i % 2 else second).write(f"runner {i % 2} line {i:04d}\n".encode())
    first.close()
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runner.log", "runner.log.1"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    assert path.read_bytes().endswith(b"runner 1 line 0299\n")
