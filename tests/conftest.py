"""Shared fixtures: a real PostgreSQL, a migrated template cloned per test, a real HTTP server.

PostgreSQL: the embedded server (started once per session in a temporary folder), or the server
named by DATABASE_URL (any PostgreSQL 14+ where we may create databases).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy
import uvicorn
from PIL import Image

from app import auth, db, migrate, modelsfile, pgserver, storage
from app.api.main import create_app
from app.queue.manager import JobManager
from app.queue.planner import PlannerConfig
from app.queue.worker import Worker
from app.queue.workerconfig import WorkerConfig
from app.settings import Settings
from tests import dbadmin
from tests.fakes import FakeInventory

HERE = Path(__file__).resolve().parent
TOY = HERE / "models" / "toy.py"
# Tests' lease: short, so that a lost worker's jobs come back within a test.
LEASE_S = 3

for _name in list(os.environ):
    if _name.startswith("GPUJOBS_"):
        del os.environ[_name]


def modules_loaded_by(module: str) -> set[str]:
    """The modules a fresh Python process holds after `import module` (run from the repo root)."""
    code = f"import sys; import {module}; print(' '.join(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], cwd=HERE.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


# This test session, among others that may run on the host at once: xdist's run id (shared by its
# processes), else this process's id.
_SESSION = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")[:8] or str(os.getpid())


def worker_name(name: str) -> str:
    """A worker's name as this test process gives it: `name`, tagged with the test session and the
    pytest-xdist process. A worker's start kills what a past life of its identity left running on
    the host (app/queue/leftovers.py), and refuses to start beside a live one: test processes
    sharing a host, of one session or of two, must not share names."""
    tag = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{name}-{_SESSION}-{tag}" if tag else f"{name}-{_SESSION}"


def worker_id(name: str) -> str:
    """The identity of the in-process worker `make_worker(name=name)` builds."""
    return f"test:{worker_name(name)}"


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """asyncpg URL of a server where tests may create databases."""
    external = os.environ.get("DATABASE_URL")
    if external:
        url = Settings(database_url=external).database_url
        assert url is not None
        yield url
        return
    folder = Path(tempfile.mkdtemp(prefix="gpujobs-test-pg-"))
    server = pgserver.EmbeddedPostgres(folder / "pgdata")
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _with_database(url: str, name: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
async def template_db(server_url: str) -> AsyncIterator[str]:
    """A database migrated to head once per session, used as the template of every test's."""
    name = f"gpujobs_tmpl_{os.getpid()}"
    await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}")
    await asyncio.to_thread(migrate.upgrade, _with_database(server_url, name))
    # No lease runs out within a lease of the server's start (app/queue/sql.py, _server_up_for): a
    # test that lets one run out in a session's first seconds would wait for a reap that never came.
    await asyncio.sleep(max(0.0, LEASE_S + 0.5 - await dbadmin.up_for_s(server_url)))
    yield name
    await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
async def database_url(server_url: str, template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    name = f"gpujobs_t_{uuid.uuid4().hex[:12]}"
    await dbadmin.admin(server_url, f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield _with_database(server_url, name)
    await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


TOY_PARAMS = """
[models.{name}.params.sleep]
type = "float"
min = 0
max = 60
default = 0
[models.{name}.params.steps]
type = "int"
min = 0
max = 100
default = 2
[models.{name}.params.exit_code]
type = "int"
min = 0
max = 255
default = 0
[models.{name}.params.fail_attempts]
type = "int"
min = 0
max = 10
default = 0
[models.{name}.params.signal]
type = "str"
choices = ["none", "SIGKILL", "SIGSEGV"]
default = "none"
[models.{name}.params.oom_attempts]
type = "int"
min = 0
max = 10
default = 0
[models.{name}.params.noise_kb]
type = "int"
min = 0
max = 1000000
default = 0
[models.{name}.params.output]
type = "bool"
default = true
[models.{name}.params.trace]
type = "str"
default = "none"
[[models.{name}.outputs]]
name = "out.txt"
media_type = "text/plain"
"""


def toy_model(name: str, *, timeout_s: float = 30, max_attempts: int = 3) -> str:
    """Registry TOML for a toy model (tests/models/toy.py) under `name`."""
    argv = [
        "{python}",
        str(TOY),
        "--input",
        "{input}",
        "--output-dir",
        "{output_dir}",
        "--sleep",
        "{sleep}",
        "--steps",
        "{steps}",
        "--exit-code",
        "{exit_code}",
        "--fail-attempts",
        "{fail_attempts}",
        "--signal",
        "{signal}",
        "--output",
        "{output}",
        "--trace",
        "{trace}",
        "--oom-attempts",
        "{oom_attempts}",
        "--noise-kb",
        "{noise_kb}",
    ]
    head = f"""
[models.{name}]
description = "Test model: sleeps, reports progress, writes out.txt"
argv = {json.dumps(argv)}
vram = {{ base_mb = 1000, mb_per_megapixel = 0 }}
timeout_s = {timeout_s}
max_attempts = {max_attempts}
bad_input_exit_codes = [65]
"""
    return head + TOY_PARAMS.replace("{name}", name)


def script_model(name: str, argv: list[str], *, max_attempts: int = 1, output: str = "out.txt") -> str:
    """Registry TOML for a one-shot model that runs `argv` (placeholders as in any argv), 10 s at
    most, 1000 MB, one declared output file; params go in `[models.<name>.params.*]` after it."""
    return f"""
[models.{name}]
argv = {json.dumps(argv)}
vram = {{ base_mb = 1000 }}
timeout_s = 10
max_attempts = {max_attempts}
[[models.{name}.outputs]]
name = "{output}"
"""


WARM_TOY = HERE / "models" / "warm_toy.py"


def warm_model(name: str, loads: Path, *, idle_vram_mb: int = 1000, timeout_s: float = 30) -> str:
    """Registry TOML for a persistent test model (tests/models/warm_toy.py) counting loads in `loads`."""
    serve = ["{python}", str(WARM_TOY), "--loads", str(loads)]
    params = "".join(
        f'[models.{name}.params.{param}]\ntype = "{kind}"\ndefault = {default}\n'
        for param, kind, default in (
            ("sleep", "float", "0.0"),
            ("steps", "int", "2"),
            ("crash_attempts", "int", "0"),
            ("hang", "bool", "false"),
            ("junk", "bool", "false"),
            ("noise_kb", "int", "0"),
            ("temp", "bool", "false"),
            ("retire_ms", "int", "-1"),
            ("daemon", "bool", "false"),
        )
    )
    return f"""
[models.{name}]
description = "Persistent test model"
mode = "persistent"
argv = ["{{python}}", "-c", "raise SystemExit('{name} runs only as a warm runner')"]
serve_argv = {json.dumps(serve)}
vram = {{ base_mb = 1000 }}
idle_vram_mb = {idle_vram_mb}
timeout_s = {timeout_s}
max_attempts = 3
{params}[[models.{name}.outputs]]
name = "out.txt"
media_type = "text/plain"
"""


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """Test-only models: `toy`, `toy_timeout` (1 s, one attempt), and persistent `warm_a`, `warm_b`
    (6000 MB held while idle, loads counted in tmp_path/loads-<name>.txt)."""
    path = tmp_path / "test-models.toml"
    path.write_text(
        toy_model("toy")
        + toy_model("toy_timeout", timeout_s=1, max_attempts=1)
        + warm_model("warm_a", tmp_path / "loads-warm_a.txt", idle_vram_mb=6000, timeout_s=3)
        + warm_model("warm_b", tmp_path / "loads-warm_b.txt", idle_vram_mb=6000)
    )
    return path


@pytest.fixture
def settings(database_url: str, tmp_path: Path, models_file: Path) -> Settings:
    """Settings for one test: its own database and storage folder, one virtual 24 GB GPU."""
    return Settings(
        database_url=database_url,
        storage_dir=tmp_path / "storage",
        models_file=models_file,
        gpus="24GiB",
        vram_buffer_mb=0,
        run_worker=False,
        worker_name=worker_name("api"),  # the in-process worker of api_client(run_worker=True)
        link_secret="test-secret-of-enough-length",
        retry_base_s=0.05,
        retry_max_s=0.2,
        kill_grace_s=0.5,
        lease_s=LEASE_S,
        heartbeat_interval_s=0.5,
        reap_interval_s=0.5,
        poll_interval_s=0.5,
    )


@pytest.fixture
async def engine(settings: Settings) -> AsyncIterator[Any]:
    """The test database's engine."""
    assert settings.database_url
    engine = db.create_engine(settings.database_url, pool_size=5)
    yield engine
    await engine.dispose()


@pytest.fixture
def manager(engine: Any) -> JobManager:
    """A JobManager on the test database."""
    return JobManager(engine)


@pytest.fixture
def store(settings: Settings) -> storage.ResultStore:
    """The test's storage folder."""
    return storage.ResultStore(settings.storage_dir)


@pytest.fixture
def make_worker(manager: JobManager, store: storage.ResultStore, settings: Settings) -> Callable[..., Worker]:
    """Build a worker on fake GPUs (default: one 24 GB GPU), burst mode unless told otherwise; a
    worker that is not in burst mode LISTENs at `listen_url` (default: the test database's)."""

    def build(
        gpus_mb: list[int] | None = None,
        *,
        burst: bool = True,
        name: str = "w1",
        inventory: FakeInventory | None = None,
        manager_: JobManager | None = None,
        store_: storage.ResultStore | None = None,
        listen_url: str | None = None,
        **config: Any,
    ) -> Worker:
        # Keyword arguments go to WorkerConfig or, for scheduling, to its PlannerConfig.
        planned = {f.name for f in dataclasses.fields(PlannerConfig)}
        scheduling = PlannerConfig(
            **{"vram_buffer_mb": 0, **{k: v for k, v in config.items() if k in planned}}
        )
        values: dict[str, Any] = {
            "worker_id": worker_id(name),
            "lease_s": settings.lease_s,
            "heartbeat_interval_s": settings.heartbeat_interval_s,
            "poll_interval_s": 0.05 if burst else settings.poll_interval_s,
            "reap_interval_s": settings.reap_interval_s,
            "kill_grace_s": settings.kill_grace_s,
            "shutdown_grace_s": 5.0,
            "retry_base_s": settings.retry_base_s,
            "retry_max_s": settings.retry_max_s,
            "python": sys.executable,
            "burst": burst,
            "scheduling": scheduling,
            **{k: v for k, v in config.items() if k not in planned},
        }
        assert settings.database_url
        return Worker(
            manager=manager_ or manager,
            store=store_ or store,
            models=modelsfile.load_registry(settings.models_file),
            inventory=inventory or FakeInventory(gpus_mb or [24_576]),
            config=WorkerConfig(**values),
            listen_dsn=None if burst else db.asyncpg_dsn(listen_url or settings.database_url),
        )

    return build


@contextlib.asynccontextmanager
async def serving(app: Any, *, http: Any = "auto") -> AsyncIterator[str]:
    """Run `app` under uvicorn on a free loopback port, with uvicorn's `http` protocol; yields its
    base URL.

    Started and stopped step by step rather than with `Server.serve()`, whose stop waits out its
    0.1 s tick and then a fixed 0.1 s pause: about 0.2 s a test, for hundreds of tests. The steps
    are serve()'s own, in its order; only the waits are shorter.
    """
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, loop="none", lifespan="on", log_level="warning", http=http
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup()
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await _stop_serving(server)


async def _stop_serving(server: uvicorn.Server, *, grace_s: float = 10) -> None:
    """Stop listening, close idle connections, let requests in flight finish (cancelled after
    `grace_s`), then run the application's shutdown."""
    for listener in server.servers:
        listener.close()
    state = server.server_state
    for connection in list(state.connections):
        connection.shutdown()
    if state.tasks:
        _, late = await asyncio.wait(set(state.tasks), timeout=grace_s)
        for task in late:
            task.cancel()
    for listener in server.servers:
        await listener.wait_closed()
    await server.lifespan.shutdown()


async def create_key(database_url: str, principal: str = "admin", *, admin: bool = False) -> str:
    """A new API key for `principal`, stored straight through app.auth; returns its secret."""
    engine = db.create_engine(database_url, pool_size=1)
    try:
        role = auth.Role.admin if admin else auth.Role.user
        return (await auth.KeyStore(engine).create(principal, role=role)).secret
    finally:
        await engine.dispose()


# Every test client shares one TLS context: httpx builds a new one per client otherwise, loading
# the CA bundle each time (about 45 ms a client on a CI machine), though the tests speak plain HTTP.
_TLS = ssl.create_default_context()


def http_client(base_url: str | httpx.URL, key: str | None = None) -> httpx.AsyncClient:
    """An HTTP client of the API at `base_url`, with `key` (None: no key)."""
    return httpx.AsyncClient(base_url=base_url, timeout=30, headers=bearer(key), verify=_TLS)


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header for `key` (none for None)."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


_ADMIN: Any = object()


@contextlib.asynccontextmanager
async def api_client(
    settings: Settings, *, key: str | None = _ADMIN, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """Serve the API for `settings` (with `overrides`) and yield a client for it, over real HTTP.

    Every test that talks HTTP goes through here, so how a test client authenticates is decided
    in one place: by default with a new admin key of principal "admin"; `key=` another key, or
    None for no key at all. `client.app` is the served FastAPI application; `client_for(client,
    key)` gives a second client of the same server for another key.
    """
    if key is _ADMIN:
        assert settings.database_url
        key = await create_key(settings.database_url, "admin", admin=True)
    app = create_app(settings.model_copy(update=overrides))
    async with (
        serving(app) as base,
        http_client(base, key) as http,
    ):
        http.app = app  # type: ignore[attr-defined]
        yield http


@contextlib.asynccontextmanager
async def client_for(http: httpx.AsyncClient, key: str | None) -> AsyncIterator[httpx.AsyncClient]:
    """Another client of the server behind `http`, with `key` (None: no key)."""
    async with http_client(http.base_url, key) as other:
        other.app = http.app  # type: ignore[attr-defined]
        yield other


XRW = {"X-Requested-With": "gpujobs"}  # what the web page's scripts send


async def signed_in(http: httpx.AsyncClient, key: str) -> httpx.Response:
    """POST the key to the sign-in route as the page's script does; the client keeps the cookie."""
    return await http.post("/ui/session", json={"key": key}, headers=XRW)


@pytest.fixture
def make_key(settings: Settings) -> Callable[..., Any]:
    """`await make_key(principal, admin=False)`: a new API key in the test database."""

    async def make(principal: str, *, admin: bool = False) -> str:
        assert settings.database_url
        return await create_key(settings.database_url, principal, admin=admin)

    return make


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client talking to the API over a real socket (no in-process worker)."""
    async with api_client(settings) as http:
        yield http


def png_bytes(
    size: tuple[int, int] = (64, 48), color: tuple[int, int, int] = (200, 100, 50), mode: str = "RGB"
) -> bytes:
    """A small real PNG with a gradient (distinct colors give distinct files)."""
    image = Image.new(mode, size, color if mode == "RGB" else None)
    if mode == "RGB":
        for x in range(size[0]):
            image.putpixel((x, 0), (x % 256, color[1], color[2]))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def png() -> Callable[..., bytes]:
    """Factory of small PNG images."""
    return png_bytes


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_serving(
    process: subprocess.Popen[bytes], base: str, log: Path, *, timeout_s: float = 60
) -> None:
    """Wait for a `gpujobs serve` process to answer `/healthz`; fail with its log if it exits or
    takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base, timeout=1, verify=_TLS) as http:
        while True:
            try:
                if http.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)


def worker_env(settings: Settings, name: str, **overrides: Any) -> dict[str, str]:
    """The environment of a `gpujobs worker` process for this test's database and storage."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/tmp"),
        "GPUJOBS_DATABASE_URL": settings.database_url or "",
        "GPUJOBS_STORAGE_DIR": str(settings.storage_dir),
        "GPUJOBS_MODELS_FILE": str(settings.models_file),
        "GPUJOBS_WORKER_NAME": worker_name(name),
        "GPUJOBS_GPUS": "24GiB",
        "GPUJOBS_VRAM_BUFFER_MB": "0",
        "GPUJOBS_LEASE_S": str(settings.lease_s),
        "GPUJOBS_HEARTBEAT_INTERVAL_S": str(settings.heartbeat_interval_s),
        "GPUJOBS_REAP_INTERVAL_S": str(settings.reap_interval_s),
        "GPUJOBS_POLL_INTERVAL_S": str(settings.poll_interval_s),
        "GPUJOBS_KILL_GRACE_S": str(settings.kill_grace_s),
        "GPUJOBS_RETRY_BASE_S": str(settings.retry_base_s),
        "GPUJOBS_RETRY_MAX_S": str(settings.retry_max_s),
        "GPUJOBS_LOG_LEVEL": "INFO",
    }
    env.update({f"GPUJOBS_{k.upper()}": str(v) for k, v in overrides.items()})
    return env


@pytest.fixture
def spawn_worker(settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start `python -m app worker` processes; all are killed at the end of the test."""
    import subprocess

    from app.queue import leftovers

    started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(name: str, *args: str, **overrides: Any) -> subprocess.Popen[bytes]:
        with (tmp_path / f"worker-{name}-{len(started)}.log").open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "app", "worker", *args],
                env=worker_env(settings, name, **overrides),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append((name, process))
        return process

    yield spawn
    for _, process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
    # Models run in sessions of their own: a worker killed mid-job leaves them running.
    for name in {name for name, _ in started}:
        for group in leftovers.find_worker_models(f"{socket.gethostname()}:{worker_name(name)}"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)


async def lock_waiter(engine: Any, query_like: str, *, timeout_s: float = 10.0) -> int:
    """The pid of a session of this database that waits for a lock in a statement LIKE
    `query_like`, once there is one (the test fails after `timeout_s`)."""
    waiting = sqlalchemy.text(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE :like LIMIT 1"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with engine.connect() as probe:
            pid = await probe.scalar(waiting, {"like": query_like})
        if pid is not None:
            return int(pid)
        await asyncio.sleep(0.02)
    pytest.fail(f"no statement like {query_like!r} waited for a lock")
