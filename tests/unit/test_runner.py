"""Tests for app.runner with tiny real model scripts (no mocks)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from app import childprocess, progress, runlog, runner

# Async tests carry their own mark: a module-level `pytestmark` would also mark the sync tests,
# which pytest-asyncio reports as a warning (an error under `filterwarnings = error`).
GRACE_S = 0.3

# A grandchild that ignores SIGTERM, announces its pid atomically, and sleeps.
GRANDCHILD = (
    "import os, pathlib, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "tmp = pathlib.Path('grandchild.tmp')\n"
    "tmp.write_text(str(os.getpid()))\n"
    "tmp.rename('grandchild.pid')\n"
    "time.sleep(60)\n"
)


def _script(tmp_path: Path, body: str) -> list[str]:
    """Write a Python model script and return its argv."""
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def _spawner(tmp_path: Path, then: str, *, new_session: bool = False) -> list[str]:
    """A model that starts GRANDCHILD, waits for its pid file, then runs `then`."""
    setsid = "start_new_session=True" if new_session else "start_new_session=False"
    body = (
        "import pathlib, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}], {setsid})\n"
        "while not pathlib.Path('grandchild.pid').exists():\n"
        "    time.sleep(0.01)\n"
        "print('PROGRESS 0.5 spawned', flush=True)\n"
        f"{then}\n"
    )
    return _script(tmp_path, body)


def _process(tmp_path: Path, argv: list[str], **kwargs: Any) -> runner.ModelProcess:
    """A ModelProcess with a scratch cwd, a minimal env and short limits."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    kwargs.setdefault("timeout_s", 10.0)
    kwargs.setdefault("env", runner.minimal_env(None))
    return runner.ModelProcess(
        argv, cwd=scratch, log_path=tmp_path / "logs" / "run.log", kill_grace_s=GRACE_S, **kwargs
    )


async def _run(process: runner.ModelProcess) -> runner.RunResult:
    """Start and wait."""
    await process.start()
    return await process.wait()


def _alive(pid: int) -> bool:
    """Whether pid is a live (non-zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _gone(pid: int, within_s: float = 2.0) -> bool:
    """Wait until pid is no longer alive; False if it still is after `within_s`."""
    for _ in range(int(within_s / 0.02)):
        if not _alive(pid):
            return True
        await asyncio.sleep(0.02)
    return not _alive(pid)


def _grandchild_pid(tmp_path: Path) -> int:
    """The pid the grandchild wrote into the scratch dir."""
    return int((tmp_path / "scratch" / "grandchild.pid").read_text())


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("PROGRESS 0.25 loading weights\n", (0.25, "loading weights")),
        ("PROGRESS 1", (1.0, "")),
        ("PROGRESS 7 too far", (1.0, "too far")),
        ("PROGRESS -0.5", (0.0, "")),
        ("  PROGRESS .5   spaced out  ", (0.5, "spaced out")),
        ("PROGRESS abc", None),
        ("PROGRESS nan", None),
        ("PROGRESS", None),
        ("progress 0.5", None),
        ("hello", None),
        ("", None),
    ],
)
def test_parse_progress(line: str, expected: tuple[float, str] | None) -> None:
    assert progress.parse_progress(line) == expected


def test_minimal_env_keeps_only_safe_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUJOBS_DATABASE_URL", "postgresql+asyncpg://u:secret@db/gpujobs")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nope")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("LANG", raising=False)
    env = runner.minimal_env(None, {"HOME": "/scratch"})
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PATH"] == "/usr/bin:/bin"
    assert env["LANG"] == "C.UTF-8"
    assert env["HOME"] == "/scratch"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "HOME"} | {
        "CUDA_VISIBLE_DEVICES",
        "PYTHONUNBUFFERED",
    }
    assert runner.minimal_env(2)["CUDA_VISIBLE_DEVICES"] == "2"
    with pytest.raises(ValueError):
        runner.minimal_env(-1)


@pytest.mark.asyncio
async def test_success_reports_progress_in_order_and_logs_both_streams(tmp_path: Path) -> None:
    seen: list[tuple[float, str]] = []

    async def on_progress(fraction: float, message: str) -> None:
        seen.append((fraction, message))

    argv = _script(
        tmp_path,
        """
        import os, sys
        print("PROGRESS 0.25 loading")
        print("warming up on stderr", file=sys.stderr)
        print("PROGRESS abc")
        print("PROGRESS 0.5")
        print(f"pgid-is-pid {os.getpgid(0) == os.getpid()} cwd {os.getcwd()}")
        print("PROGRESS 2 done")
        """,
    )
    process = _process(tmp_path, argv, on_progress=on_progress)
    pid = await process.start()
    assert process.pid == pid
    result = await process.wait()
    assert result.ok and result.exit_code == 0 and result.signal is None
    # Printed at once, the updates are coalesced (app/progress.py): those that reach the callback
    # come in order, and the last one printed always does.
    assert seen[-1] == (1.0, "done") and seen == sorted(seen)
    assert set(seen) <= {(0.25, "loading"), (0.5, ""), (1.0, "done")}
    log = (tmp_path / "logs" / "run.log").read_text()
    assert "warming up on stderr" in log and "PROGRESS abc" in log
    assert f"pgid-is-pid True cwd {tmp_path / 'scratch'}" in log
    assert "PROGRESS 2 done" in result.log_tail
    assert await process.wait() is result


@pytest.mark.asyncio
async def test_nonzero_exit_code(tmp_path: Path) -> None:
    argv = _script(tmp_path, "import sys\nprint('bad input', file=sys.stderr)\nsys.exit(3)\n")
    result = await _run(_process(tmp_path, argv))
    assert (result.exit_code, result.signal, result.timed_out, result.stopped) == (3, None, False, None)
    assert not result.ok
    assert "bad input" in result.log_tail


@pytest.mark.asyncio
async def test_killed_by_its_own_signal(tmp_path: Path) -> None:
    argv = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    result = await _run(_process(tmp_path, argv))
    assert result.exit_code is None
    assert result.signal == signal.SIGSEGV
    assert not result.ok


@pytest.mark.asyncio
async def test_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    process = _process(tmp_path, _spawner(tmp_path, "time.sleep(60)"), timeout_s=1.5)
    result = await _run(process)
    assert result.timed_out and not result.ok
    assert result.signal == signal.SIGTERM
    assert "timed out" in result.log_tail
    assert await _gone(_grandchild_pid(tmp_path)), "the grandchild ignoring SIGTERM survived"


@pytest.mark.asyncio
async def test_forked_helper_does_not_outlive_a_clean_exit(tmp_path: Path) -> None:
    result = await _run(_process(tmp_path, _spawner(tmp_path, "sys.exit(0)")))
    assert result.ok
    assert result.duration_s < 5, "wait() waited for the helper's pipes instead of killing it"
    assert await _gone(_grandchild_pid(tmp_path))
    assert "pipes still open" not in result.log_tail


@pytest.mark.asyncio
async def test_a_process_that_left_the_group_does_not_hang_wait(tmp_path: Path) -> None:
    result = await _run(_process(tmp_path, _spawner(tmp_path, "sys.exit(0)", new_session=True)))
    escaped = _grandchild_pid(tmp_path)
    try:
        assert result.ok and result.escaped  # the caller finds it by its marker
        assert "pipes still open" in result.log_tail
    finally:
        os.kill(escaped, signal.SIGKILL)


@pytest.mark.asyncio
async def test_stop_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    started = asyncio.Event()

    async def on_progress(fraction: float, message: str) -> None:
        started.set()

    argv = _script(tmp_path, "import time\nprint('PROGRESS 0.1 started')\ntime.sleep(60)\n")
    process = _process(tmp_path, argv, on_progress=on_progress)
    await process.start()
    waiting = asyncio.create_task(process.wait(), name="test-wait")
    await asyncio.wait_for(started.wait(), 5)
    with caplog.at_level(logging.WARNING, logger="gpujobs.runner"):
        process.stop("canceled")
        process.stop("shutdown")  # the first reason wins
        result = await waiting
    assert result.stopped == "canceled" and not result.timed_out and not result.ok
    assert result.signal == signal.SIGTERM
    assert result.duration_s < 5
    assert any(getattr(r, "action", None) == "run_stopped" for r in caplog.records)


@pytest.mark.asyncio
async def test_stop_escalates_to_sigkill_after_grace(tmp_path: Path) -> None:
    argv = _script(
        tmp_path,
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("PROGRESS 0.1 stubborn", flush=True)
        time.sleep(60)
        """,
    )
    started = asyncio.Event()

    async def on_progress(fraction: float, message: str) -> None:
        started.set()

    process = _process(tmp_path, argv, on_progress=on_progress)
    await process.start()
    waiting = asyncio.create_task(process.wait(), name="test-wait")
    await asyncio.wait_for(started.wait(), 5)
    process.stop("lease lost")
    result = await waiting
    assert result.signal == signal.SIGKILL and result.stopped == "lease lost"
    assert "SIGKILL" in result.log_tail


@pytest.mark.asyncio
async def test_environment_is_minimal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUJOBS_DATABASE_URL", "postgresql+asyncpg://u:secret@db/gpujobs")
    argv = _script(tmp_path, "import json, os\nopen('env.json', 'w').write(json.dumps(dict(os.environ)))\n")
    env = runner.minimal_env(0, {"HOME": str(tmp_path / "scratch")})
    result = await _run(_process(tmp_path, argv, env=env))
    assert result.ok
    seen = json.loads((tmp_path / "scratch" / "env.json").read_text())
    assert "GPUJOBS_DATABASE_URL" not in seen
    assert "secret" not in json.dumps(seen)
    assert seen["CUDA_VISIBLE_DEVICES"] == "0"
    assert set(seen) - {"LC_CTYPE"} == set(env)  # Python may add LC_CTYPE itself (PEP 538)


@pytest.mark.asyncio
async def test_cancelling_wait_kills_the_process(tmp_path: Path) -> None:
    argv = _script(tmp_path, "import time\ntime.sleep(60)\n")
    process = _process(tmp_path, argv)
    pid = await process.start()
    waiting = asyncio.create_task(process.wait(), name="test-wait")
    await asyncio.sleep(0.3)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not _alive(pid)
    assert "cancelled" in (tmp_path / "logs" / "run.log").read_text()


@pytest.mark.asyncio
async def test_overlong_lines_do_not_crash_the_reader(tmp_path: Path) -> None:
    seen: list[tuple[float, str]] = []

    async def on_progress(fraction: float, message: str) -> None:
        seen.append((fraction, message))

    argv = _script(
        tmp_path,
        """
        import sys
        sys.stdout.write("PROGRESS 0.9 " + "x" * 200_000 + "\\n")
        sys.stdout.write("y" * 150_000 + "\\n")
        sys.stdout.write("PROGRESS 0.5 after\\n")
        sys.stderr.write("z" * 100_000)
        """,
    )
    result = await _run(_process(tmp_path, argv, on_progress=on_progress))
    assert result.ok
    assert seen == [(0.5, "after")]
    assert (tmp_path / "logs" / "run.log").stat().st_size > 450_000
    assert len(result.log_tail) <= runlog.TAIL_BYTES


@pytest.mark.asyncio
async def test_both_pipes_flooded_do_not_deadlock(tmp_path: Path) -> None:
    argv = _script(
        tmp_path,
        """
        import sys
        line = "e" * 1000 + "\\n"
        for _ in range(2000):
            sys.stderr.write(line)
        for _ in range(2000):
            sys.stdout.write(line)
        """,
    )
    result = await _run(_process(tmp_path, argv, timeout_s=10.0))
    assert result.ok
    assert (tmp_path / "logs" / "run.log").stat().st_size >= 4_000_000


@pytest.mark.asyncio
async def test_failing_progress_callback_does_not_kill_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def on_progress(fraction: float, message: str) -> None:
        raise RuntimeError("database is down")

    argv = _script(  # apart, so that the first is not coalesced into the second (app/progress.py)
        tmp_path, "import time\nprint('PROGRESS 0.5', flush=True)\ntime.sleep(0.3)\nprint('PROGRESS 1')\n"
    )
    with caplog.at_level(logging.ERROR, logger="gpujobs.runner"):
        result = await _run(_process(tmp_path, argv, on_progress=on_progress))
    assert result.ok
    failures = [r for r in caplog.records if getattr(r, "action", None) == "progress_callback_failed"]
    assert len(failures) == 2


@pytest.mark.asyncio
async def test_missing_executable_raises_oserror(tmp_path: Path) -> None:
    process = _process(tmp_path, [str(tmp_path / "no-such-model")])
    with pytest.raises(FileNotFoundError):
        await process.start()
    assert process.pid is None


async def test_an_exit_is_seen_at_once_even_while_a_child_holds_the_pipes(tmp_path: Path) -> None:
    proc = await childprocess.spawn(
        "/bin/sh",
        "-c",
        "sleep 3 & exit 7",
        limit=1024,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert await asyncio.wait_for(proc.exited(), 2.0) == 7  # Process.wait() (3.11) waits for the pipe
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    started = asyncio.get_running_loop().time()
    for _ in range(20):  # polling for the exit would add its interval to each run
        assert (await _run(_process(tmp_path, ["/bin/true"]))).exit_code == 0
    assert asyncio.get_running_loop().time() - started < 20 * 0.025


@pytest.mark.asyncio
async def test_a_quiet_run_needs_no_task_of_its_own(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    made: list[str] = []
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, context: Any = None) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, context=context)

    async def on_progress(fraction: float, message: str) -> None:
        raise AssertionError("/bin/true reports no progress")

    loop.set_task_factory(factory)
    try:
        result = await _run(_process(tmp_path, ["/bin/true"], on_progress=on_progress))
    finally:
        loop.set_task_factory(previous)
    assert result.ok
    assert made == [], "the pipes, the exit and the cleanup need no task when nothing is printed"
    assert not (tmp_path / "logs").exists(), "a quiet run that ended well makes no log file"
    tail = result.log_tail  # the worker's lines are kept for the job's error, if it fails later
    assert tail.startswith("[runner] started pid") and tail.endswith("[runner] exit code 0")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/bin/false"], ["[runner] started pid", "[runner] exit code 1"]),
        (["sh", "-c", "echo said >&2"], ["[runner] started pid", "said", "[runner] exit code 0"]),
    ],
    ids=["quiet-but-failed", "printed"],
)
async def test_a_run_that_printed_or_failed_has_its_whole_log(
    tmp_path: Path, argv: list[str], expected: list[str]
) -> None:
    await _run(_process(tmp_path, argv))
    lines = (tmp_path / "logs" / "run.log").read_text().splitlines()
    assert len(lines) == len(expected), lines
    assert all(line.startswith(e) for line, e in zip(lines, expected, strict=True)), lines


@pytest.mark.asyncio
async def test_progress_split_across_writes_and_an_unterminated_last_line(tmp_path: Path) -> None:
    seen: list[tuple[float, str]] = []

    async def on_progress(fraction: float, message: str) -> None:
        seen.append((fraction, message))

    argv = _script(
        tmp_path,
        """
        import sys, time
        # Each line is completed more than the feed's interval after the one before, so none is
        # coalesced into the next (app/progress.py).
        for piece in ("PROGRESS 0.", "3 split", "\\nPRO", "GRESS 0.6 c\\n"):
            sys.stdout.write(piece)
            sys.stdout.flush()
            time.sleep(0.4 if "\\n" in piece else 0.05)
        sys.stdout.write("PROGRESS 0.9 no newline")
        """,
    )
    result = await _run(_process(tmp_path, argv, on_progress=on_progress))
    assert result.ok
    assert seen == [(0.3, "split"), (0.6, "c"), (0.9, "no newline")]
    assert "PROGRESS 0.3 split\nPROGRESS 0.6 c\n" in (tmp_path / "logs" / "run.log").read_text()


@pytest.mark.asyncio
@pytest.mark.parametrize("stop", [False, True])
async def test_without_pidfds_a_thread_waits_for_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: bool
) -> None:
    monkeypatch.delattr(os, "pidfd_open", raising=False)  # as before Linux 5.3
    argv = _script(tmp_path, "import sys, time\ntime.sleep(float(sys.argv[1]))\nsys.exit(3)\n")
    process = _process(tmp_path, [*argv, "60" if stop else "0"])
    pid = await process.start()
    assert f"runner-wait-{pid}" in {thread.name for thread in threading.enumerate()}
    if stop:
        process.stop("canceled")
    result = await asyncio.wait_for(process.wait(), 5)
    expected = (None, signal.SIGTERM, "canceled") if stop else (3, None, None)
    assert (result.exit_code, result.signal, result.stopped) == expected
