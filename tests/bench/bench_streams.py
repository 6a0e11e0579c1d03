"""What an open event stream costs its API process, and what one key polling costs other users.

Run on demand, never by pytest:

    .venv/bin/python -m tests.bench.bench_streams [--only streams|polling] [--quick]
        [--streams N] [--requests N] [--connections N] [--load-s S] [--tmp-dir DIR]

It starts its own `gpujobs serve --no-worker` (as `python -m app serve`) on a free loopback port,
with a fresh embedded PostgreSQL in a temporary folder (`--tmp-dir` picks its parent), makes two
user keys with `gpujobs keys create` (principals `bench-a` and `bench-b`), and submits one small
PNG of the model `relief` with each (no worker runs, so both jobs stay queued and their streams
open). It prints numbers and asserts nothing; at the end it stops the server with SIGTERM (the
embedded PostgreSQL stops with it), says whether any process was left, and removes the folder.
The server is started with a soft limit of 1024 open files (what systemd gives a service), so the
first lines show that `serve` raised it. Every setting that differs from its default is printed.
The figures it checks: docs/operations.md, "Following a job live" (what an open stream costs) and
docs/security.md, "Upload hardening" ("many reads from one key"). MB and KB are those of
/proc/PID/status: 1024-based.

streams (one principal, `--streams` N event streams of its one job; `GPUJOBS_STREAMS_PER_KEY` is
raised to allow them; the API process is `serve` itself, since `GPUJOBS_API_PROCESSES` is 1):
- *RSS before*: VmRSS of the API process once warm (job reads, its history, a few streams opened
  and closed, the stream gauge back at 0) and settled (no move over 64 KB for 2 s).
- *RSS with N open*: VmRSS once each of the N streams (one connection each, opened 64 at a time)
  had its answer's head and first `state` event (so the server holds it: subscribed, its history
  read) and RSS settled; with the process's open files and `gpujobs_stream_subscribers`.
- *per stream*: (with - before) / N, in KB; the total in MB.
- *RSS after close*: once every stream was closed by this client, the gauge read 0 and RSS
  settled: what the process keeps (Python's allocator seldom gives memory back). *peak*: VmHWM.

polling (user B reads its job while user A polls its own):
- *B alone*: `--requests` sequential `GET /jobs/{id}` of B's job over one kept-alive connection
  (the lean client, tests/bench/rawhttp.py), after 10 unmeasured: p50, p99, mean in ms.
- *A's load*: another process sends `GET /jobs/{id}` of A's job back to back on `--connections`
  kept-alive connections (asyncio, the lean client): its answers per second and failures, from
  the moment each connection had its first answer until B is done.
- *B under load*: from that moment, B's 10 unmeasured requests, then its sequential requests for
  `--load-s` seconds, timed as alone (n says how many: with fewer than 100, p99 is the slowest).
- *slowdown*: B under load over B alone, at p50 and at p99.

B's connection is kept alive as a browser's or an SDK's is, so its latencies include what the
server's socket options cost such a client: answers written in two sends (head, then body) waited
for the client's delayed ACK (about 40 ms on Linux) while `serve`'s connections lacked TCP_NODELAY
(B alone: p50 48 ms then, 2.7 ms since; tests/unit/test_serve_socket.py).

Other benchmarks on the same cores move these numbers: the load average is printed at the start
and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from tests.bench import rawhttp
from tests.bench.bench_throughput import status_kb

ROOT = Path(__file__).resolve().parents[2]  # the checkout: `python -m app` runs from there
PARTS = ("streams", "polling")  # --only picks one
HOST = "127.0.0.1"
SERVER_SOFT_FILES = 1024  # the server starts with this soft limit on open files, as systemd gives
OPEN_AT_ONCE = 64  # streams being opened at a time
WARM_STREAMS = 8  # streams opened and closed before the "before" reading
SETTLE_KB = 64  # RSS has settled when it moved less than this ...
SETTLE_S = 2.0  # ... over this long
SETTLE_LIMIT_S = 30.0
WARM_REQUESTS = 10  # unmeasured requests before each timed series


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much each part does."""

    streams: int
    requests: int
    connections: int
    load_s: float


@dataclass(frozen=True, slots=True)
class Server:
    """The running `serve`, its two keys and their jobs."""

    proc: subprocess.Popen[bytes]
    port: int
    key_a: str
    key_b: str
    job_a: str
    job_b: str

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"


# --- the API process, seen from /proc ---------------------------------------------------------


def open_files(pid: int) -> int:
    """Descriptors the process holds."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def files_limit(pid: int) -> str:
    """The process's soft and hard limits on open files, from /proc/<pid>/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return f"soft {soft}, hard {hard}"
    return "unknown"


async def settled_kb(pid: int) -> tuple[int, float]:
    """VmRSS once it moved less than SETTLE_KB over SETTLE_S (or after SETTLE_LIMIT_S); (kB, the
    seconds it took)."""
    start = time.monotonic()
    samples: list[tuple[float, int]] = []
    while True:
        now = time.monotonic()
        samples.append((now, status_kb(pid, "VmRSS")))
        window = [kb for at, kb in samples if at >= now - SETTLE_S]
        steady = now - samples[0][0] >= SETTLE_S and max(window) - min(window) < SETTLE_KB
        if steady or now - start >= SETTLE_LIMIT_S:
            return samples[-1][1], now - start
        await asyncio.sleep(0.25)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- the server ----------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def server_env(storage: Path, port: int, sizes: Sizes) -> tuple[dict[str, str], dict[str, str]]:
    """(the environment for `serve` and `keys`, the settings in it that differ from the defaults).
    Inherited GPUJOBS_ variables are dropped, as the test suite drops them."""
    settings = {
        "GPUJOBS_STORAGE_DIR": str(storage),
        "GPUJOBS_PORT": str(port),
        "GPUJOBS_STREAMS_PER_KEY": str(sizes.streams + WARM_STREAMS),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUJOBS_")}
    env.update(settings, GPUJOBS_HOST=HOST)
    return env, settings


def _low_files_limit() -> None:
    """In the server's process before exec: the soft limit systemd gives a service."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = SERVER_SOFT_FILES if hard == resource.RLIM_INFINITY else min(SERVER_SOFT_FILES, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start_server(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """`python -m app serve --no-worker`, in its own session, its output to `log_path`."""
    argv = [sys.executable, "-m", "app", "serve", "--no-worker"]
    with log_path.open("wb") as log:
        return subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_low_files_limit,  # fork-safe: nothing else runs in this process yet
        )  # fmt: skip


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log_path: Path, limit_s: float = 180) -> float:
    """Seconds until GET /healthz answered 200; RuntimeError with the log's tail if it never did."""
    start = time.monotonic()
    with httpx.Client(base_url=base, timeout=2) as client:
        while time.monotonic() - start < limit_s and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/healthz").status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.2)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the API did not start (exit code {proc.poll()}):\n{tail}")


def make_key(env: dict[str, str], name: str) -> str:
    """`gpujobs keys create NAME` on the server's storage folder (it joins the running embedded
    PostgreSQL); the key it prints."""
    done = subprocess.run(
        [sys.executable, "-m", "app", "keys", "create", name],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"keys create {name}: exit {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def png() -> bytes:
    """A small PNG to upload."""
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 30, 200)).save(out, "PNG")
    return out.getvalue()


def submit(base: str, key: str) -> str:
    """POST /jobs of a small PNG for the model `relief`; the job's id (it stays queued)."""
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        response = client.post(
            "/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "relief"}
        )
    if response.status_code != 201:
        raise RuntimeError(f"POST /jobs answered {response.status_code}: {response.text[:300]}")
    return str(response.json()["id"])


def stop_server(proc: subprocess.Popen[bytes], tmp: Path) -> None:
    """SIGTERM, then wait; SIGKILL its session if it would not go. Then say whether anything that
    used the temporary folder (the embedded PostgreSQL) is still running, and stop it if so."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        print("serve did not exit within 60 s of SIGTERM: its session was killed")
    print(f"serve exit code after SIGTERM: {code} (143 expected)")
    left = leftovers(tmp)
    time_left = time.monotonic() + 10
    while left and time.monotonic() < time_left:  # PostgreSQL may still be finishing its stop
        time.sleep(0.5)
        left = leftovers(tmp)
    print(f"processes left using the temporary folder: {left or 'none'}")
    for pid in left:  # the postmaster first: SIGINT is PostgreSQL's fast shutdown
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGINT)


def leftovers(tmp: Path) -> list[int]:
    """Live processes whose command line names the temporary folder (the embedded PostgreSQL's
    is `postgres -D <tmp>/storage/pgdata`), this one aside."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if str(tmp).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return sorted(found)


# --- streams -------------------------------------------------------------------------------------


async def open_stream(port: int, job: str, key: str) -> asyncio.StreamWriter:
    """GET /jobs/{job}/stream, read until its first `state` event (the server then holds the stream:
    subscribed, history read); the open connection."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(
            f"GET /jobs/{job}/stream HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {key}\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        async with asyncio.timeout(120):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.split(b" ", 2)[1] != b"200":
                raise RuntimeError(f"the stream was answered {head[:300]!r}")
            await reader.readuntil(b"event: state")
            await reader.readuntil(b"\n\n")
    except BaseException:
        writer.close()
        raise
    return writer


async def open_streams(port: int, job: str, key: str, count: int) -> list[asyncio.StreamWriter]:
    """`count` streams of `job`, OPEN_AT_ONCE being opened at a time."""
    gate = asyncio.Semaphore(OPEN_AT_ONCE)

    async def one() -> asyncio.StreamWriter:
        async with gate:
            return await open_stream(port, job, key)

    results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    writers = [r for r in results if isinstance(r, asyncio.StreamWriter)]
    failures = [r for r in results if not isinstance(r, asyncio.StreamWriter)]
    if failures:
        await close_streams(writers)
        raise RuntimeError(f"{len(failures)} of {count} streams failed to open; first: {failures[0]!r}")
    return writers


async def close_streams(writers: list[asyncio.StreamWriter]) -> None:
    """Close every stream's connection from this side."""
    for writer in writers:
        writer.close()
    await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)


async def stream_gauge(client: httpx.AsyncClient) -> float:
    """gpujobs_stream_subscribers from GET /metrics (summed over its series)."""
    text = (await client.get("/metrics")).text
    lines = [line for line in text.splitlines() if line.startswith("gpujobs_stream_subscribers")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def gauge_reaches(client: httpx.AsyncClient, value: float, limit_s: float = 60) -> float:
    """Wait until the stream gauge reads `value` (or `limit_s` passed); the value last read."""
    for _ in range(int(limit_s / 0.25)):
        if (seen := await stream_gauge(client)) == value:
            return seen
        await asyncio.sleep(0.25)
    return await stream_gauge(client)


async def warm_up(server: Server, client: httpx.AsyncClient) -> None:
    """Requests of each kind the part makes, a few streams opened and closed, the gauge back at 0."""
    for _ in range(WARM_REQUESTS):
        (await client.get(f"/jobs/{server.job_a}")).raise_for_status()
        (await client.get(f"/jobs/{server.job_a}/events")).raise_for_status()
    await close_streams(await open_streams(server.port, server.job_a, server.key_a, WARM_STREAMS))
    await gauge_reaches(client, 0)


async def streams_part(server: Server, sizes: Sizes) -> None:
    """Print the API process's RSS before, with `sizes.streams` streams open, and after closing."""
    pid, n = server.proc.pid, sizes.streams
    print(f"\nstreams: {n} event streams of one job, one principal (bench-a), API process pid {pid}")
    headers = {"Authorization": f"Bearer {server.key_a}"}
    async with httpx.AsyncClient(base_url=server.base, headers=headers, timeout=60) as client:
        await warm_up(server, client)
        before_kb, took_s = await settled_kb(pid)
        files_before, peak_kb = open_files(pid), status_kb(pid, "VmHWM")
        print(f"  RSS before            {before_kb / 1024:8.1f} MB  (settled in {took_s:.1f} s)"
              f"   open files {files_before}   peak so far {peak_kb / 1024:.1f} MB")  # fmt: skip
        start = time.monotonic()
        writers = await open_streams(server.port, server.job_a, server.key_a, n)
        opened_s = time.monotonic() - start
        with_kb, took_s = await settled_kb(pid)
        gauge, files_with = await stream_gauge(client), open_files(pid)
        print(f"  RSS with {n} open   {with_kb / 1024:8.1f} MB  (opened in {opened_s:.1f} s, settled in "
              f"{took_s:.1f} s)   open files {files_with} (+{files_with - files_before})   "
              f"gpujobs_stream_subscribers {gauge:.0f}")  # fmt: skip
        grown = with_kb - before_kb
        print(f"  per stream            {grown / n:8.1f} KB   ({grown / 1024:.1f} MB for {n} streams)")
        await close_streams(writers)
        gauge = await gauge_reaches(client, 0)
        after_kb, took_s = await settled_kb(pid)
        print(f"  RSS after close       {after_kb / 1024:8.1f} MB  (settled in {took_s:.1f} s)"
              f"   open files {open_files(pid)}   gpujobs_stream_subscribers {gauge:.0f}")  # fmt: skip
        print(f"  peak (VmHWM)          {status_kb(pid, 'VmHWM') / 1024:8.1f} MB")


# --- polling -------------------------------------------------------------------------------------


def get_head(port: int, job: str, key: str) -> bytes:
    """The bytes of GET /jobs/{job} with `key`."""
    return rawhttp.request_head(
        "GET", f"{HOST}:{port}", f"/jobs/{job}", {"Authorization": f"Bearer {key}"}, 0
    )


def poll_in_process(port: int, job: str, key: str, connections: int, ready: EventType, stop: EventType,
                    results: Any) -> None:  # fmt: skip
    """User A's load, in its own process: GET /jobs/{job} back to back on `connections` kept-alive
    connections until `stop`; puts (answers 200, failures, seconds) counted from `ready`."""
    results.put(asyncio.run(_poll(port, get_head(port, job, key), connections, ready, stop)))


async def _poll(port: int, head: bytes, connections: int, ready: EventType, stop: EventType
                ) -> tuple[int, int, float]:  # fmt: skip
    pool = rawhttp.Connections(HOST, port)
    counts = {"ok": 0, "bad": 0}
    marks: dict[str, float] = {}

    async def one_connection() -> None:
        while not stop.is_set():
            try:
                answer = await pool.send(head, b"")
            except (OSError, rawhttp.BadAnswer):
                counts["bad"] += 1
                await asyncio.sleep(0.01)
                continue
            counts["ok" if answer.status == 200 else "bad"] += 1
            if not marks and counts["ok"] >= connections:  # every connection has answered once
                marks.update(at=time.monotonic(), ok=counts["ok"], bad=counts["bad"])
                ready.set()

    try:
        await asyncio.gather(*(one_connection() for _ in range(connections)))
    finally:
        await pool.close()
    if not marks:
        return 0, counts["bad"], 0.0
    return counts["ok"] - int(marks["ok"]), counts["bad"] - int(marks["bad"]), time.monotonic() - marks["at"]


async def timed_gets(port: int, head: bytes, *, count: int = 0, for_s: float = 0) -> list[float]:
    """Milliseconds of sequential GETs on one kept-alive connection: `count` of them, or as many as
    `for_s` seconds take; WARM_REQUESTS unmeasured ones first."""
    pool = rawhttp.Connections(HOST, port)
    took: list[float] = []
    try:
        for _ in range(WARM_REQUESTS):
            await pool.send(head, b"")
        end = time.monotonic() + for_s
        while len(took) < count or (for_s and time.monotonic() < end):
            start = time.perf_counter()
            answer = await pool.send(head, b"")
            took.append((time.perf_counter() - start) * 1000)
            if answer.status != 200:
                raise RuntimeError(f"GET answered {answer.status}: {answer.body[:200]!r}")
    finally:
        await pool.close()
    return took


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))]


def latency_line(name: str, took: list[float]) -> str:
    """p50, p99, mean and count."""
    mean = sum(took) / len(took)
    return f"  {name:<22} p50 {percentile(took, 50):7.2f} ms   p99 {percentile(took, 99):7.2f} ms   " \
        f"mean {mean:7.2f} ms   n={len(took)}"  # fmt: skip


async def under_load(
    server: Server, sizes: Sizes, head_b: bytes
) -> tuple[list[float], tuple[int, int, float]]:
    """B's latencies while A's process polls; (B's milliseconds, A's (answers, failures, seconds))."""
    spawn = multiprocessing.get_context("spawn")
    ready, stop, results = spawn.Event(), spawn.Event(), spawn.Queue()
    args = (server.port, server.job_a, server.key_a, sizes.connections, ready, stop, results)
    poller = spawn.Process(target=poll_in_process, args=args, name="bench-a-poller")
    poller.start()
    try:
        if not await asyncio.to_thread(ready.wait, 60):
            raise RuntimeError("A's poller did not get an answer on every connection within 60 s")
        took = await timed_gets(server.port, head_b, for_s=sizes.load_s)
    finally:
        stop.set()
    answered = await asyncio.to_thread(results.get, True, 60)
    await asyncio.to_thread(poller.join, 30)
    return took, answered


async def polling_part(server: Server, sizes: Sizes) -> None:
    """Print B's GET /jobs/{id} latency alone and while A polls over `sizes.connections`."""
    print(f"\npolling: B reads its job; A polls its own over {sizes.connections} connections")
    head_b = get_head(server.port, server.job_b, server.key_b)
    alone = await timed_gets(server.port, head_b, count=sizes.requests)
    print(latency_line("B alone", alone))
    loaded, (ok, bad, seconds) = await under_load(server, sizes, head_b)
    rate = ok / seconds if seconds else 0.0
    print(f"  A's load               {rate:7.0f} req/s over {seconds:.1f} s   ({ok} answered 200, "
          f"{bad} failed), {sizes.connections} connections")  # fmt: skip
    print(latency_line("B under A's load", loaded))
    p50 = percentile(loaded, 50) / percentile(alone, 50)
    p99 = percentile(loaded, 99) / percentile(alone, 99)
    print(f"  slowdown of B          p50 {p50:.1f}x   p99 {p99:.1f}x")


# --- main ----------------------------------------------------------------------------------------


def more_open_files(streams: int) -> str:
    """Raise this process's soft limit on open files to its hard limit if the streams need more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = streams + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted * 4, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return f"soft {soft}, hard {hard}"


@contextlib.contextmanager
def running_server(tmp: Path, sizes: Sizes) -> Iterator[Server]:
    """`serve --no-worker` on a free port with its keys and jobs; stopped on the way out."""
    port = free_port()
    env, settings = server_env(tmp / "storage", port, sizes)
    log_path = tmp / "serve.log"
    print("settings not at their defaults: " + ", ".join(f"{k}={v}" for k, v in settings.items())
          + ", GPUJOBS_RUN_WORKER=false (--no-worker)")  # fmt: skip
    proc = start_server(env, log_path)
    try:
        took_s = wait_healthy(proc, f"http://{HOST}:{port}", log_path)
        print(f"serve (pid {proc.pid}) answered /healthz after {took_s:.1f} s; its open-files limit: "
              f"{files_limit(proc.pid)} (started with soft {SERVER_SOFT_FILES})")  # fmt: skip
        key_a, key_b = make_key(env, "bench-a"), make_key(env, "bench-b")
        base = f"http://{HOST}:{port}"
        yield Server(proc, port, key_a, key_b, submit(base, key_a), submit(base, key_b))
    finally:
        stop_server(proc, tmp)


async def run_parts(server: Server, sizes: Sizes, parts: tuple[str, ...]) -> None:
    """The parts asked for, in order."""
    if "streams" in parts:
        await streams_part(server, sizes)
    if "polling" in parts:
        await polling_part(server, sizes)


def parse_args(argv: list[str] | None = None) -> tuple[Sizes, tuple[str, ...], Path | None]:
    """(sizes, the parts to run, the temporary folder's parent)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_streams", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--only", choices=PARTS, help="run only this part (default both)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of both parts")
    parser.add_argument("--streams", type=int, default=None, help="streams to open (default 1000)")
    parser.add_argument("--requests", type=int, default=None, help="B's requests alone (default 200)")
    parser.add_argument("--connections", type=int, default=64, help="A's connections (default 64)")
    parser.add_argument("--load-s", type=float, default=None, help="seconds of A's load (default 10)")
    parser.add_argument("--tmp-dir", type=Path, default=None, help="parent of the temporary folder")
    args = parser.parse_args(argv)
    streams, requests, load_s = (100, 50, 3.0) if args.quick else (1000, 200, 10.0)
    sizes = Sizes(args.streams or streams, args.requests or requests, args.connections, args.load_s or load_s)
    return sizes, (args.only,) if args.only else PARTS, args.tmp_dir


def main(argv: list[str] | None = None) -> None:
    """Start the server, run the parts, stop it, remove the temporary folder."""
    sizes, parts, parent = parse_args(argv)
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {load_average()}   cores: {os.cpu_count()}")
    print(f"this process's open-files limit: {more_open_files(sizes.streams)}")
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-bench-streams-", dir=parent))
    started = time.monotonic()
    try:
        with running_server(tmp, sizes) as server:
            asyncio.run(run_parts(server, sizes, parts))
    except KeyboardInterrupt:
        sys.exit("interrupted; the server was stopped and the temporary folder removed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average at end: {load_average()}   (total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
