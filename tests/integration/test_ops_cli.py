"""The operator's commands as the README and docs/operations.md describe them, run as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import pytest

from tests.conftest import api_client, free_port, wait_until_serving, worker_env
from tests.integration.test_client import gpujobs


def test_serve_runs_no_worker_when_the_setting_says_so(settings, tmp_path):
    """GPUJOBS_RUN_WORKER=false is documented as turning off `serve`'s in-process worker; the
    `--worker/--no-worker` flag's default overrode it, so a worker ran (and claimed jobs) anyway."""
    port = free_port()
    env = worker_env(settings, "no-worker", run_worker="false")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", str(port)], env=env, stdout=out, stderr=out
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_serving(serve, base, log)
        ready = httpx.get(f"{base}/readyz", timeout=10).json()
        assert ready["workers"] == 0, (ready, log.read_text())
    finally:
        serve.terminate()
        serve.wait(timeout=30)


async def test_a_refused_request_prints_the_servers_reasons_readably(settings, make_key):
    """A request FastAPI refuses before our code (a path, query or body that does not parse) has
    a list of errors as its detail: the client printed that list's Python repr (`[{'type':
    'uuid_parsing', 'loc': ['path', 'job_id'], ...}]`), wrapped over several lines. (A job id
    that is not a UUID no longer reaches the server: test_client.py.)"""
    key = await make_key("ops", admin=True)
    async with api_client(settings) as http:
        code, _, stderr = await gpujobs(http, key, "jobs", "list", "--state", "bogus")
        assert code == 2 and stderr.startswith("error: 422: state: Input should be 'queued'"), stderr
        assert "{'type'" not in stderr and len(stderr.splitlines()) == 1, stderr
        code, _, stderr = await gpujobs(http, key, "prune", "--older-than", "99999999w", "--dry-run")
        assert code == 2 and stderr.startswith("error: 422: older_than_s: Input should be less than"), stderr


async def test_a_client_error_is_one_line_whatever_the_terminal(settings, tmp_path):
    """Run from a script or cron (stderr not a terminal, no COLUMNS), an error was wrapped at 80
    columns: a URL or a message broken over lines that a log search or `grep error:` would miss."""
    from tests.integration.test_client import run_cli

    url = "http://127.0.0.1:9/a/long/path/that/makes/the/message/longer/than/eighty/columns"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "GPUJOBS_URL": url}
    code, _, stderr = await run_cli(env, "jobs", "list")
    assert code == 2 and stderr.startswith(f"error: cannot reach {url}"), stderr
    assert len(stderr.splitlines()) == 1, stderr


async def test_models_shows_each_default_as_submit_param_takes_it(tmp_path):
    """`gpujobs models` printed defaults and choices as Python reprs (`default False`, `choices
    ['glb', 'stl', 'obj']`): `--param invert=False` copied from it was refused (422: a string),
    and `--param format='glb'` named no choice."""
    from app import cli_submit, modelsfile
    from tests.integration.test_client import run_cli

    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
    code, stdout, stderr = await run_cli(env, "models")
    assert code == 0, stderr
    specs = modelsfile.load_registry(None).models
    shown = 0
    for line in stdout.splitlines():
        words = line.split()
        if words[:1] == ["--param"]:
            name = words[1].split("=")[0]
            default = words[words.index("default") + 1]
            spec = specs["relief"].params[name]
            assert cli_submit.parse_params([f"{name}={default}"]) == {name: spec.default}, line
            if spec.choices:
                listed = words[words.index("choices") + 1]
                assert [cli_submit.parse_params([f"c={c}"])["c"] for c in listed.split("|")] == list(
                    spec.choices
                )
            shown += 1
    assert shown >= len(specs["relief"].params)


async def test_a_schema_newer_than_the_code_is_named_not_a_traceback(settings, engine):
    """After a rollback of the code (a newer release had migrated the database), `gpujobs migrate`
    crashed with Alembic's traceback ("Can't locate revision identified by '0099'"), exit 1, and
    `serve` and `worker` told the operator to run `gpujobs migrate`, which could not help."""
    from sqlalchemy import text

    from app import migrate
    from tests.integration.test_client import run_cli

    async with engine.begin() as conn:
        await conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    env = worker_env(settings, "newer")
    env["COLUMNS"] = "400"
    for args in (["migrate"], ["worker", "--burst"], ["serve", "--no-worker", "--port", str(free_port())]):
        code, _, stderr = await run_cli(env, *args, timeout_s=120)
        assert code == 2, (args, stderr[-3000:])
        assert "Traceback" not in stderr and "─" not in stderr, (args, stderr[-3000:])
        [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert "0099" in line and "newer" in line and f"its newest is {migrate.head()}" in line, line
        assert "run `gpujobs migrate`" not in line, line
    async with engine.connect() as conn:  # and nothing was changed
        assert await conn.scalar(text("SELECT version_num FROM alembic_version")) == "0099"


async def exit_without_the_workers_table(engine, process: subprocess.Popen[bytes]) -> int:
    """Take the heartbeat's table away under a running worker (its heartbeat then dies), and
    return the process's exit code (within 60 s); the table is put back whatever happens."""
    import asyncio

    from sqlalchemy import text

    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE workers RENAME TO workers_gone"))
    try:
        return await asyncio.wait_for(asyncio.to_thread(process.wait), timeout=60)
    finally:
        async with engine.begin() as conn:
            await conn.execute(text("ALTER TABLE workers_gone RENAME TO workers"))


async def test_a_worker_that_stops_on_its_own_exits_non_zero(settings, engine, spawn_worker, tmp_path):
    """A worker whose heartbeat, reaper or listener dies stops (it cannot keep its leases); the
    process then exited 0, as after a requested stop, so a supervisor restarting on failure
    (systemd Restart=on-failure, a Kubernetes Job) left the host without a worker."""
    import asyncio

    from sqlalchemy import text

    worker = spawn_worker("stops", heartbeat_interval_s="0.2", lease_s="5")
    async with asyncio.timeout(60):
        while True:
            async with engine.connect() as conn:
                if await conn.scalar(text("SELECT count(*) FROM workers WHERE state = 'running'")):
                    break
            await asyncio.sleep(0.1)
    code = await exit_without_the_workers_table(engine, worker)
    assert code == 1, code
    log = (tmp_path / "worker-stops-0.log").read_text()
    assert "side task" in log and "error: the worker stopped after an error" in log, log[-3000:]


async def test_serve_refuses_a_port_out_of_range_like_the_setting(tmp_path):
    """GPUJOBS_PORT=99999 is refused by name, but `serve --port 99999` crashed in bind() with an
    OverflowError traceback (exit 1), after starting the database; and `--port 0` was ignored
    (served on GPUJOBS_PORT)."""
    from tests.integration.test_client import run_cli

    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
    env["GPUJOBS_STORAGE_DIR"] = str(tmp_path / "storage")
    for port in ("99999", "0"):
        code, _, stderr = await run_cli(env, "serve", "--no-worker", "--port", port, timeout_s=60)
        assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
        assert "Invalid value for '--port'" in stderr, stderr
    assert not (tmp_path / "storage" / "pgdata").exists()  # refused before anything started


async def test_keys_on_a_database_never_migrated_says_to_migrate(server_url, tmp_path):
    """`gpujobs keys create admin --admin` before `gpujobs migrate` (the first thing a new
    installation does) printed SQLAlchemy's traceback of `relation "api_keys" does not exist`,
    exit 1; serve and worker say in one line to run `gpujobs migrate`."""
    from tests.integration.test_client import run_cli
    from tests.test_migrations import empty_database

    async with empty_database(server_url) as url:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
        env["GPUJOBS_DATABASE_URL"] = url
        for args in (["keys", "create", "admin", "--admin"], ["keys", "list"], ["keys", "revoke", "1"]):
            code, stdout, stderr = await run_cli(env, *args, timeout_s=60)
            assert code == 2 and stdout == "" and "Traceback" not in stderr, (args, stderr[-3000:])
            [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert "schema is at nothing" in line and "run `gpujobs migrate`" in line, line


async def test_a_database_user_without_the_rights_it_needs_is_told_in_one_line(settings, tmp_path):
    """A role that may not read gpujobs's tables (or, for `migrate`, create them: PostgreSQL 15 and
    later give no CREATE on schema public to a role that does not own the database) got a
    traceback of 450 to 620 lines, exit 1."""
    from sqlalchemy.engine import make_url

    from tests import dbadmin
    from tests.integration.test_client import run_cli

    role = f"gj_norights_{uuid.uuid4().hex[:8]}"
    url = settings.database_url or ""
    await dbadmin.admin(
        url, f"CREATE ROLE {role} LOGIN PASSWORD 'pw'", "REVOKE CREATE ON SCHEMA public FROM PUBLIC"
    )
    try:
        as_role = make_url(url).set(username=role, password="pw").render_as_string(hide_password=False)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
        env["GPUJOBS_DATABASE_URL"] = as_role
        env["GPUJOBS_STORAGE_DIR"] = str(tmp_path / "storage")
        for args in (["keys", "list"], ["migrate"], ["serve", "--port", str(free_port())]):
            code, _, stderr = await run_cli(env, *args, timeout_s=60)
            assert code == 2 and "Traceback" not in stderr, (args, stderr[-3000:])
            [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert f"the database user {role!r} lacks a right" in line and "permission denied" in line, line
            assert "pw" not in line.replace("permission", ""), line
    finally:
        await dbadmin.admin(url, f"DROP OWNED BY {role}", f"DROP ROLE {role}")


async def test_a_storage_dir_that_cannot_be_used_is_named(settings, tmp_path):
    """GPUJOBS_STORAGE_DIR naming a file (or a folder this user cannot write) crashed `worker` with
    a NotADirectoryError traceback (exit 1), `serve` with uvicorn's traceback of a FileExistsError
    (exit 3), and `migrate` on the embedded database likewise."""
    from tests.integration.test_client import run_cli

    taken = tmp_path / "not-a-folder"
    taken.write_text("a file")
    env = {**worker_env(settings, "storage"), "GPUJOBS_STORAGE_DIR": str(taken), "COLUMNS": "400"}
    embedded = {k: v for k, v in env.items() if k != "GPUJOBS_DATABASE_URL"}
    cases = [
        (env, ["worker", "--burst"]),
        (env, ["serve", "--port", str(free_port())]),
        (embedded, ["migrate"]),
    ]
    for run_env, args in cases:
        code, _, stderr = await run_cli(run_env, *args, timeout_s=60)
        assert code == 2 and "Traceback" not in stderr, (args, stderr[-3000:])
        [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert line.startswith(f"error: GPUJOBS_STORAGE_DIR: cannot use {taken}"), line
    assert taken.read_text() == "a file"


@pytest.mark.parametrize("in_the_way", ["logs", "scratch", "results", "link_secret/"])
async def test_something_in_the_way_inside_the_storage_dir_is_named(settings, tmp_path, in_the_way):
    """Only the storage folder itself was checked: a file where its `logs`, `scratch` or `results`
    folder goes, or a folder named `link_secret`, crashed `worker` with a FileExistsError traceback
    (exit 1) and `serve` with uvicorn's traceback (exit 3) or an IsADirectoryError's (exit 1)."""
    from tests.integration.test_client import run_cli

    settings.storage_dir.mkdir(parents=True)
    taken = settings.storage_dir / in_the_way.rstrip("/")
    if in_the_way.endswith("/"):
        taken.mkdir()
    else:
        taken.write_text("a file")
    env = {**worker_env(settings, "storage"), "COLUMNS": "400"}
    commands = [["serve", "--port", str(free_port())]]
    if in_the_way != "link_secret/":  # a worker signs no links
        commands.append(["worker", "--burst"])
    for args in commands:
        code, _, stderr = await run_cli(env, *args, timeout_s=60)
        assert code == 2 and "Traceback" not in stderr and "─" not in stderr, (args, stderr[-3000:])
        [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert line.startswith(f"error: GPUJOBS_STORAGE_DIR: cannot use {taken}: "), line


async def test_serve_whose_worker_stops_on_its_own_exits_non_zero(settings, engine, tmp_path):
    """The in-process worker's heartbeat died and the worker stopped; `serve` went on answering,
    /readyz said ready, and no job ran on that host again until someone looked."""
    import asyncio

    port = free_port()
    env = worker_env(settings, "serve-stops", heartbeat_interval_s="0.2", lease_s="5")
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "app", "serve", "--port", str(port)]
    with log.open("wb") as out:
        serve = await asyncio.to_thread(subprocess.Popen, argv, env=env, stdout=out, stderr=out)
    try:
        wait_until_serving(serve, f"http://127.0.0.1:{port}", log)
        code = await exit_without_the_workers_table(engine, serve)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    said = log.read_text()
    assert code == 1, said[-3000:]
    assert "error: the in-process worker stopped after an error" in said, said[-3000:]


async def test_a_database_url_with_libpq_sslmode_works_and_a_bad_one_is_one_line(settings, tmp_path):
    """`?sslmode=disable` (libpq's, common in URLs copied from elsewhere) crashed serve, worker and
    migrate with `TypeError: connect() got an unexpected keyword argument 'sslmode'`, and a port
    out of range with an OverflowError traceback, exit 1. Now the first works, through SQLAlchemy
    and through LISTEN's plain URL, and the second is one line naming the setting, exit 2."""
    import asyncpg
    from sqlalchemy.engine import make_url

    from app import db
    from app.settings import Settings
    from tests.integration.test_client import run_cli

    assert settings.database_url
    with_sslmode = make_url(settings.database_url).update_query_dict({"sslmode": "disable"})
    url = with_sslmode.render_as_string(hide_password=False)
    env = {**worker_env(settings, "sslmode"), "GPUJOBS_DATABASE_URL": url, "COLUMNS": "400"}
    for args in (["migrate"], ["keys", "list"]):
        code, _, stderr = await run_cli(env, *args, timeout_s=120)
        assert code == 0, (args, stderr[-3000:])
    listen_dsn = db.asyncpg_dsn(Settings(database_url=url).database_url or "")
    conn = await asyncpg.connect(listen_dsn)
    await conn.close()

    env["GPUJOBS_DATABASE_URL"] = "postgresql://postgres@127.0.0.1:99999/x"
    code, _, stderr = await run_cli(env, "migrate", timeout_s=60)
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    [line] = stderr.splitlines()
    assert line.startswith("error: invalid configuration: GPUJOBS_DATABASE_URL: port 99999"), line


async def test_the_largest_values_allowed_run_jobs_and_the_api_still_answers(
    settings, manager, spawn_worker, tmp_path
):
    """Settings past PostgreSQL's integer failed in SQL: a virtual GPU of 1e12 MB made the claim fail
    and POST /jobs and GET /models answer 500, GPUJOBS_QUARANTINE_AFTER=3e9 stopped the worker at
    start, a queue limit of 1e20 made every POST /jobs a 500. The largest values allowed work: the
    worker claims and runs a job, the API reads its GPUs back and queues a job."""
    import asyncio

    from app import gpu
    from app.queue.jobs import JobState
    from app.settings import PG_INT_MAX
    from tests.conftest import png_bytes
    from tests.integration.test_worker import enqueue

    job_id = await enqueue(manager)
    largest = {"virtual_gpu_mb": gpu.MAX_GPU_MB, "quarantine_after": PG_INT_MAX, "max_jobs_per_gpu": 10_000}
    worker = spawn_worker("largest", "--burst", gpus="", **largest)
    code = await asyncio.wait_for(asyncio.to_thread(worker.wait), timeout=120)
    log = next(tmp_path.glob("worker-largest-*.log")).read_text()
    assert code == 0, log[-3000:]
    job = await manager.get(job_id)
    assert job is not None and job.state is JobState.succeeded, log[-3000:]
    async with api_client(settings, queue_limit=PG_INT_MAX, queue_limit_per_key=PG_INT_MAX) as http:
        assert (await http.get("/models")).status_code == 200
        files = {"image": ("a.png", png_bytes(), "image/png")}
        assert (await http.post("/jobs", files=files, data={"model": "toy"})).status_code == 201


async def test_migrate_over_tables_it_did_not_record_is_one_line_and_changes_nothing(
    server_url, database_url, tmp_path
):
    """`gpujobs migrate` into a database holding a table of one of our names but no alembic_version
    (another application's `workers`, or a migrated database whose alembic_version was dropped)
    printed SQLAlchemy's DuplicateTable traceback, exit 1. Now one line, exit 2, nothing changed."""
    import asyncpg

    from app import db
    from tests.integration.test_client import run_cli
    from tests.test_migrations import empty_database

    async def run(url: str, statement: str) -> str:
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        try:
            await conn.execute(statement)
        finally:
            await conn.close()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
        code, stdout, stderr = await run_cli({**env, "GPUJOBS_DATABASE_URL": url}, "migrate", timeout_s=120)
        assert code == 2 and stdout == "" and "Traceback" not in stderr, stderr[-3000:]
        [line] = [line for line in stderr.splitlines() if line.startswith("error:")]  # after Alembic's
        return line

    async with empty_database(server_url) as url:
        line = await run(url, "CREATE TABLE workers (x int)")
        assert line.startswith("error: the database holds tables named as gpujobs's (workers) but no "), line
        assert "empty database" in line, line
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        try:
            tables = await conn.fetch(
                "SELECT relname FROM pg_class WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
            )
        finally:
            await conn.close()
        assert [t["relname"] for t in tables] == ["workers"]  # nothing created beside it
    line = await run(database_url, "DROP TABLE alembic_version")
    assert line.startswith("error: the database holds tables named as gpujobs's (api_keys, inputs, "), line
    async with empty_database(server_url) as url:  # a type of ours, not a table: Alembic's error
        line = await run(url, "CREATE TYPE job_state AS ENUM ('x')")
        assert line.startswith(
            """error: the database holds objects named as gpujobs's (type "job_state" """
        ), line


REFUSE_CLAIMS = (
    "CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN RAISE EXCEPTION 'claims refused by the test'; END $$",
    "CREATE TRIGGER refuse_claims BEFORE UPDATE ON jobs FOR EACH ROW "
    "WHEN (OLD.state = 'queued' AND NEW.state = 'running') EXECUTE FUNCTION refuse_claims()",
)


async def test_serve_whose_worker_fails_logs_why_once(settings, engine, manager, tmp_path):
    """The in-process worker's claim failed (an error of the database that is no outage: here a
    trigger refuses it) and serve exited 1 with "the in-process worker stopped after an error (see
    the log above)", but nothing above said which error: the worker task's exception was
    swallowed. It is logged once, with its traceback, on the ERROR line that says the worker ended."""
    import asyncio

    from sqlalchemy import text

    from tests.integration.test_worker import enqueue

    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "app", "serve", "--port", str(port)]
    with log.open("wb") as out:
        serve = await asyncio.to_thread(
            subprocess.Popen, argv, env=worker_env(settings, "claim-fails"), stdout=out, stderr=out
        )
    try:
        wait_until_serving(serve, f"http://127.0.0.1:{port}", log)
        async with engine.begin() as conn:
            for statement in REFUSE_CLAIMS:
                await conn.execute(text(statement))
        await enqueue(manager)
        code = await asyncio.wait_for(asyncio.to_thread(serve.wait), timeout=60)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert code == 1, log.read_text()[-3000:]
    said_once_why(log.read_text(), "error: the in-process worker stopped after an error")


async def test_a_worker_that_fails_logs_why_once(settings, engine, manager, spawn_worker, tmp_path):
    """`gpujobs worker` whose claim failed so died of the exception, which came out as typer's
    boxed traceback of several kilobytes, outside the log (and its format), with no `error:` line.
    It is logged as serve's is, then the one line, exit 1 (in burst mode too: this is no end of the
    queue)."""
    import asyncio

    from sqlalchemy import text

    from tests.integration.test_worker import enqueue

    async with engine.begin() as conn:
        for statement in REFUSE_CLAIMS:
            await conn.execute(text(statement))
    await enqueue(manager)
    for run, args in enumerate([(), ("--burst",)]):
        worker = spawn_worker("claim-fails", *args)
        code = await asyncio.wait_for(asyncio.to_thread(worker.wait), timeout=60)
        said = (tmp_path / f"worker-claim-fails-{run}.log").read_text()
        assert code == 1, said[-3000:]
        said_once_why(said, "error: the worker stopped after an error")


def said_once_why(said: str, error: str) -> None:
    """The log `said` holds the claim's error, with its traceback, once, on the ERROR line that
    says the worker ended; and the command's last line is `error`."""
    assert said.count("Traceback (most recent call last)") == 1, said[-5000:]
    assert "─" not in said, said[-5000:]  # no boxed traceback of typer's
    ended = said.index("action=worker_ended")
    assert said.rindex("ERROR", 0, ended) > said.rindex("\n", 0, ended), said[-5000:]
    assert ended < said.index("Traceback") < said.index("claims refused by the test"), said[-5000:]
    assert said.strip().splitlines()[-1].startswith(error), said[-3000:]


async def test_a_bad_models_file_is_refused_before_the_database_is_made(tmp_path):
    """`serve` and `worker` on a fresh storage folder with a models file they cannot use created and
    migrated the embedded database (39 MB) before they said so; they now refuse first."""
    from tests.integration.test_client import run_cli

    models = tmp_path / "models.toml"
    models.write_text("[model.relief]\n")  # no `models` table
    storage = tmp_path / "storage"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
    env |= {"GPUJOBS_STORAGE_DIR": str(storage), "GPUJOBS_MODELS_FILE": str(models), "GPUJOBS_GPUS": "8GiB"}
    for args in (["serve", "--port", str(free_port())], ["worker", "--burst"]):
        code, _, stderr = await run_cli(env, *args, timeout_s=120)
        assert code == 2 and "Traceback" not in stderr, (args, stderr[-3000:])
        [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
        # The setting too: the path alone left an operator guessing where it was set.
        assert line.startswith(f"error: GPUJOBS_MODELS_FILE: {models}: "), line
        assert not (storage / "pgdata").exists(), args
