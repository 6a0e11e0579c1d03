"""`gpujobs serve --processes N` (GPUJOBS_API_PROCESSES): N API processes on one port.

Real `gpujobs serve` processes on a free port; the children are found in /proc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, png_bytes, wait_until_serving, worker_env
from tests.integration.test_durability import alive

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")


def api_children(pid: int) -> list[int]:
    """The API processes `gpujobs serve` (pid) started: its spawned children (not multiprocessing's
    resource tracker)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    found.append(int(child))
    return sorted(found)


def until(check, *, timeout_s: float = 30, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def serving(
    settings, tmp_path: Path, *args: str, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:  # type: ignore[no-untyped-def]
    """`gpujobs serve` with `args` on a free port; (process, base URL) once it answers; killed after."""
    port = free_port()
    log = tmp_path / "serve.log"
    environ = worker_env(settings, "serve", **env)
    # its private metrics folder here: a parent killed outright (a test below) leaves it behind
    (tmp_path / "tmp").mkdir(exist_ok=True)
    environ["TMPDIR"] = str(tmp_path / "tmp")
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", str(port), *args],
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    children: list[int] = []
    try:
        wait_until_serving(serve, base, log)
        children = api_children(serve.pid)
        yield serve, base
    finally:
        children += api_children(serve.pid) if serve.poll() is None else []
        if serve.poll() is None:
            serve.terminate()
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def fresh_get(base: str, path: str = "/healthz") -> httpx.Response:
    """A GET on a new connection (each one goes to whichever process accepts it)."""
    with httpx.Client(base_url=base, timeout=5) as http:
        return http.get(path)


def test_each_api_process_serves_the_port(settings, tmp_path):
    """With one process stopped (SIGSTOP), every new connection is answered by the other: both
    accept on the one port."""
    with serving(settings, tmp_path, "--processes", "2", "--no-worker") as (serve, base):
        children = api_children(serve.pid)
        assert len(children) == 2, children
        for stopped in children:
            os.kill(stopped, signal.SIGSTOP)
            try:
                assert [fresh_get(base).status_code for _ in range(8)] == [200] * 8
            finally:
                os.kill(stopped, signal.SIGCONT)


def healthz_count(base: str) -> float:
    """`/healthz` requests counted in the HTTP histogram, as one process's `/metrics` says."""
    text = fresh_get(base, "/metrics").text
    prefix = 'gpujobs_http_request_duration_seconds_count{method="GET",route="/healthz",status="200"} '
    return sum(float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix))


def test_every_process_reports_the_requests_of_all(settings, tmp_path):
    """Prometheus scrapes one port and reaches one process: each reports what all of them answered
    (their metrics shared through a private folder, removed at the end)."""
    with serving(settings, tmp_path, "--processes", "2", "--no-worker") as (serve, base):
        first, second = api_children(serve.pid)
        environ = Path(f"/proc/{first}/environ").read_bytes().split(b"\0")
        [folder] = [
            Path(v.split(b"=", 1)[1].decode()) for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
        ]
        assert folder.is_dir()
        before = healthz_count(base)
        for stopped, count in ((first, 5), (second, 3)):  # 5 answered by the second, then 3 by the first
            os.kill(stopped, signal.SIGSTOP)
            try:
                assert [fresh_get(base).status_code for _ in range(count)] == [200] * count
            finally:
                os.kill(stopped, signal.SIGCONT)
        # A request is counted once its answer is sent: a process stopped right after an answer
        # (as below) had not counted it yet, and the scrape read one short (8 for 9, seen).
        until(lambda: healthz_count(base) == before + 8, what="the last answers counted")
        for stopped in (first, second):  # whichever process answers the scrape
            os.kill(stopped, signal.SIGSTOP)
            try:
                assert healthz_count(base) == before + 8
            finally:
                os.kill(stopped, signal.SIGCONT)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
        assert not folder.exists()


async def test_the_worker_runs_in_one_process_and_jobs_run(settings, tmp_path, make_key):
    """Three API processes, one in-process worker (in the first): one worker is registered, and jobs
    submitted through any process run to success."""
    import asyncio

    key = await make_key("alice")
    await asyncio.to_thread(submit_and_finish, settings, tmp_path, {"Authorization": f"Bearer {key}"})


def submit_and_finish(settings, tmp_path: Path, auth: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    with serving(settings, tmp_path, "--processes", "3") as (serve, base):
        assert len(api_children(serve.pid)) == 3
        until(lambda: fresh_get(base, "/readyz").json()["workers"] == 1, what="the worker registers")
        ids = []
        for i in range(6):  # new connections, so several processes take them
            with httpx.Client(base_url=base, timeout=10, headers=auth) as http:
                image = png_bytes(color=(i, 10, 20))
                files = {"image": ("a.png", image, "image/png")}
                answer = http.post("/jobs", files=files, data={"model": "toy"})
                assert answer.status_code == 201, answer.text
                ids.append(answer.json()["id"])

        def states() -> list[str]:
            with httpx.Client(base_url=base, timeout=10, headers=auth) as http:
                return [http.get(f"/jobs/{i}").json()["state"] for i in ids]

        until(lambda: states() == ["succeeded"] * 6, timeout_s=60, what="the jobs succeed")
        workers = {fresh_get(base, "/readyz").json()["workers"] for _ in range(6)}
        assert workers == {1}, workers


def test_a_process_that_dies_is_started_again(settings, tmp_path):
    """A child killed (SIGKILL, as the kernel's OOM killer does) is replaced; the others answer meanwhile."""
    with serving(settings, tmp_path, "--processes", "2", "--no-worker") as (serve, base):
        first, second = api_children(serve.pid)
        os.kill(second, signal.SIGKILL)
        assert fresh_get(base).status_code == 200
        until(lambda: len(api_children(serve.pid)) == 2 and second not in api_children(serve.pid))
        [new] = set(api_children(serve.pid)) - {first}
        until(lambda: Path(f"/proc/{new}/net").exists())
        assert [fresh_get(base).status_code for _ in range(4)] == [200] * 4
        log = (tmp_path / "serve.log").read_text()
        assert f"API process 1 (pid {second}) ended (killed by SIGKILL)" in log, log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_stops_every_process_and_exits_0(settings, tmp_path, sig):
    """SIGHUP (the terminal closed) stops them as SIGTERM does; it killed the parent outright
    (exit 129), its children and their metrics folder left behind."""
    with serving(settings, tmp_path, "--processes", "3") as (serve, _base):
        children = api_children(serve.pid)
        serve.send_signal(sig)
        assert serve.wait(timeout=30) == 0
        assert not [pid for pid in children if alive(pid)]
        assert not list((tmp_path / "tmp").iterdir())  # the shared metrics folder is gone


async def test_one_process_on_sighup_stops_as_on_sigterm(settings, manager, tmp_path):
    """With a database URL (compose, production) nothing took SIGHUP: `serve` died at once (exit
    129), its worker left `running` in the workers table until marked dead. Only the embedded
    database's start installed the handler."""
    with serving(settings, tmp_path) as (serve, _base):
        serve.send_signal(signal.SIGHUP)
        assert await asyncio.to_thread(serve.wait, 30) == 143
    assert [w.state for w in await manager.reports.workers()] == ["stopped"]


def test_a_second_sigterm_kills_the_processes_that_do_not_stop(settings, tmp_path):
    """A child that does not stop (here: stopped with SIGSTOP, its SIGTERM pending) held the parent
    for ever; a second SIGTERM kills it, and the parent exits 1."""
    with serving(settings, tmp_path, "--processes", "2", "--no-worker") as (serve, _base):
        children = api_children(serve.pid)
        os.kill(children[0], signal.SIGSTOP)
        serve.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            serve.wait(timeout=2)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=10) == 1
        until(lambda: not [pid for pid in children if alive(pid)], what="the children end")
        # exit 1 here is the kill, not a failed worker (there is none: --no-worker)
        log = (tmp_path / "serve.log").read_text()
        assert "in-process worker stopped" not in log, log[-3000:]


def test_one_stop_request_signalled_twice_at_once_still_stops_gracefully(settings, tmp_path):
    """`timeout` (and whatever signals a process and then its group) can deliver one SIGTERM twice,
    the second just after the parent began to stop: that was taken for a second request, and the
    processes were killed (exit 1, the worker's jobs left to their leases). A repeat that close is
    the same request."""
    with serving(settings, tmp_path, "--processes", "2") as (serve, _base):
        children = api_children(serve.pid)
        log = tmp_path / "serve.log"
        serve.send_signal(signal.SIGTERM)
        until(lambda: "SIGTERM: stopping the API processes" in log.read_text(), what="the first SIGTERM")
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0, log.read_text()[-3000:]
        assert "killing the API processes" not in log.read_text()
        assert not [pid for pid in children if alive(pid)]


def test_the_processes_end_with_their_parent(settings, tmp_path):
    """A parent killed outright (SIGKILL) leaves no API process serving the port alone."""
    with serving(settings, tmp_path, "--processes", "2", "--no-worker") as (serve, base):
        children = api_children(serve.pid)
        serve.kill()
        serve.wait()
        until(lambda: not [pid for pid in children if alive(pid)], what="the children end")
        with pytest.raises(httpx.ConnectError):
            fresh_get(base)


@pytest.mark.parametrize("processes", ["1", "2"])
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"link_secret": "short"}, "GPUJOBS_LINK_SECRET must be at least 16 characters"),
        ({"models_file": "{tmp}/models.toml"}, "model 'x': field 'max_attempts': is required"),
    ],
)
def test_a_setting_the_app_refuses_is_said_in_one_line_before_serving(
    settings, tmp_path, processes, setting, said
):
    """A link secret too short, or a models file with a mistake, came out of the app's start-up as
    uvicorn's traceback, exit 3; with several processes each would fail the same way at every
    start. Now `serve` says it in one line, exit 2, and no process starts."""
    (tmp_path / "models.toml").write_text('[models.x]\nargv = ["true"]\n')
    env = worker_env(settings, "bad", **{k: v.format(tmp=tmp_path) for k, v in setting.items()})
    env["COLUMNS"] = "400"
    argv = [sys.executable, "-m", "app", "serve", "--processes", processes, "--port", str(free_port())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "started server process" not in done.stderr.lower(), done.stderr
    [line] = [line for line in done.stderr.splitlines() if said in line]
    assert line.startswith("error: "), line


@pytest.mark.parametrize(
    ("processes", "host"),
    [("1", "127.0.0.1"), ("2", "127.0.0.1"), ("1", "bad host")],
    ids=["one process, port in use", "two processes, port in use", "bad host"],
)
async def test_an_address_that_cannot_be_bound_is_said_in_one_line_and_claims_nothing(
    settings, manager, processes, host
):
    """In one process (the default), uvicorn ran the app's start-up, and so started its worker,
    before it bound the port: with the port in use the worker claimed and ran queued jobs, then the
    command died of `address already in use` (exit 3); a host that is no address likewise. The
    address is now bound first, in one process as in several: one line naming the settings, exit
    2, nothing started."""
    import socket

    from app.queue.jobs import JobState
    from tests.integration.test_client import run_cli
    from tests.integration.test_worker import enqueue

    job_id = await enqueue(manager)
    env = {**worker_env(settings, "taken"), "GPUJOBS_HOST": host, "COLUMNS": "400"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, _, stderr = await run_cli(env, "serve", "--processes", processes, "--port", port, timeout_s=60)
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: GPUJOBS_HOST/GPUJOBS_PORT (--host/--port): "), line
    assert ("address already in use" if host == "127.0.0.1" else "bad host") in line.lower(), line
    assert "API process" not in stderr and "worker started" not in stderr, stderr
    job = await manager.get(job_id)
    assert (job.state, job.attempt, job.worker_id) == (JobState.queued, 0, None), job


def test_a_process_that_cannot_be_started_stops_those_already_started(settings, tmp_path):
    """A start that fails (the spawn itself: no memory, too many processes) left the children
    started before it serving on their own, their metrics folder removed under them, and the parent
    waiting on them at its exit for ever. They are stopped."""
    import socket

    from app import supervisor

    class FailingSecond(supervisor.Supervisor):
        def _start(self, index: int, *, first: bool, pause_s: float) -> None:
            if index == 1:
                raise OSError("no room for another process")
            super()._start(index, first=first, pause_s=pause_s)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        parent = FailingSecond(settings.model_copy(update={"run_worker": False}), 2, sock)
        with pytest.raises(OSError, match="no room"):
            parent.run()
        started = list(parent.pids().values())
        assert started == [], f"still running: {started}"
