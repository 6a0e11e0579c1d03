"""The `gpujobs` client commands, run as real processes against a real API over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trimesh
import typer
from sqlalchemy import text

from app import cli_prune, cli_submit
from tests.conftest import api_client, free_port, modules_loaded_by, png_bytes
from tests.integration.test_end_to_end import gradient_png
from tests.integration.test_worker import enqueue


async def run_cli(env: dict[str, str], *args: str, timeout_s: float = 180) -> tuple[int, str, str]:
    """Run `python -m app ARGS` with `env` only; (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(timeout_s):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def gpujobs(http: Any, key: str | None, *args: str) -> tuple[int, str, str]:
    """Run `python -m app ARGS` against the server behind `http`; (exit code, stdout, stderr)."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    env["COLUMNS"] = "400"  # typer's error boxes would wrap a long path across lines
    env["GPUJOBS_URL"] = str(http.base_url)
    if key is not None:
        env["GPUJOBS_API_KEY"] = key
    return await run_cli(env, *args)


async def test_submit_wait_out_writes_the_mesh(settings, make_key, tmp_path):
    image = tmp_path / "ramp.png"
    image.write_bytes(gradient_png(120, 60))
    out = tmp_path / "out"
    key = await make_key("cli-user")
    async with api_client(settings, run_worker=True) as http:
        code, stdout, stderr = await gpujobs(
            http, key, "submit", str(image), "--model", "relief",
            "--param", "width_mm=60", "--param", "resolution=48", "--param", "format=glb",
            "--priority", "3", "--wait", "--out", str(out),
        )  # fmt: skip
        assert code == 0, stderr
        job_id = stdout.split()[0]
        job = (await http.get(f"/jobs/{job_id}")).json()
    assert job["state"] == "succeeded" and job["priority"] == 3 and job["params"]["resolution"] == 48
    assert f"job {job_id} queued" in stderr and "wrote" in stderr
    assert "no live worker" not in stderr, stderr
    mesh_path = out / "ramp" / "mesh.glb"  # the image's own folder in --out
    assert mesh_path.stat().st_size == job["files"][0]["bytes"]
    mesh = trimesh.load(mesh_path, force="mesh")
    assert mesh.is_watertight
    assert abs((mesh.bounds[1] - mesh.bounds[0])[0] - 60) < 0.01
    assert not list(out.glob("**/.*partial"))


async def test_photos_submitted_into_one_out_folder_keep_every_result(settings, make_key, tmp_path):
    """`submit a.png --out d` then `submit b.png --out d` (a loop over a folder of photos) wrote
    both results to d/out.txt: the second replaced the first without a word. Each image's results
    now go to d/<image name without extension>/."""
    key = await make_key("cli-user")
    out = tmp_path / "d"
    async with api_client(settings, run_worker=True) as http:
        ids = {}
        for name, color in (("a", (1, 2, 3)), ("b", (4, 5, 6))):
            image = tmp_path / f"{name}.png"
            image.write_bytes(png_bytes(color=color))
            code, stdout, stderr = await gpujobs(
                http, key, "submit", str(image), "-m", "toy", "--out", str(out)
            )
            assert code == 0, stderr
            ids[name] = stdout.split()[0]
            assert f"wrote {out / name / 'out.txt'}" in stderr, stderr
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    for name, job_id in ids.items():
        assert (out / name / "out.txt").read_text() == f"done {job_id}:1\n"


async def test_results_already_in_the_out_folder_are_kept_unless_forced(settings, make_key, tmp_path):
    """Submitting the same photo again into the same --out replaced the first job's result without
    a word. Now the second submit is refused before it uploads (exit 2, naming what is there);
    `--force` replaces it."""
    key = await make_key("cli-user")
    image = tmp_path / "photo.png"
    image.write_bytes(png_bytes())
    out = tmp_path / "meshes"
    async with api_client(settings, run_worker=True) as http:
        code, stdout, stderr = await gpujobs(http, key, "submit", str(image), "-m", "toy", "--out", str(out))
        assert code == 0, stderr
        first = (out / "photo" / "out.txt").read_text()
        code, _, stderr = await gpujobs(http, key, "submit", str(image), "-m", "toy", "--out", str(out))
        assert code == 2 and "Traceback" not in stderr, stderr[-2000:]
        assert f"{out / 'photo'} already holds out.txt" in stderr and "--force" in stderr, stderr
        assert (out / "photo" / "out.txt").read_text() == first
        assert len((await http.get("/jobs")).json()["jobs"]) == 1  # nothing was uploaded
        code, stdout, stderr = await gpujobs(
            http, key, "submit", str(image), "-m", "toy", "--out", str(out), "--force"
        )
        assert code == 0, stderr
    assert (out / "photo" / "out.txt").read_text() == f"done {stdout.split()[0]}:1\n" != first


async def test_submit_says_when_no_live_worker_serves_the_model(settings, make_key, tmp_path):
    """A job submitted for a model no live worker serves waits for ever, and `submit --wait` sat
    silent with it: the submitter was never told. The client now says so, and the job stays queued."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    async with api_client(settings) as http:  # no worker
        code, stdout, stderr = await gpujobs(http, await make_key("u"), "submit", str(image), "-m", "toy")
    assert code == 0 and "queued" in stdout, stderr
    assert "no live worker serves the model toy now" in stderr, stderr


async def test_submit_sends_a_text_param_as_text_though_it_reads_as_json(settings, make_key, tmp_path):
    """`-p trace=123` for a text param sent the number 123, and the server's 422 ("must be a
    string, not an integer") did not say to quote it. The client now reads the model's params in
    GET /models and sends a text param's value as text."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    async with api_client(settings) as http:
        args = ("submit", str(image), "-m", "toy", "-p", "trace=123", "-p", "steps=3", "--json")
        code, stdout, stderr = await gpujobs(http, await make_key("u"), *args)
    assert code == 0, stderr
    assert {k: json.loads(stdout)["params"][k] for k in ("trace", "steps")} == {"trace": "123", "steps": 3}


def test_params_of_a_text_type_stay_text():
    """A param the model's schema says is text is sent as written, unless quoted as a JSON string."""
    types = {"output": "str", "signal": "str", "label": "str", "steps": "int"}
    pairs = ["output=true", "signal=1", 'label="x y"', "steps=2", "other=null"]
    assert cli_submit.parse_params(pairs, types) == {
        "output": "true",
        "signal": "1",
        "label": "x y",
        "steps": 2,
        "other": None,
    }


async def test_a_failed_job_exits_non_zero_with_its_error(settings, make_key, tmp_path):
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    key = await make_key("cli-user")
    async with api_client(settings, run_worker=True) as http:
        code, stdout, stderr = await gpujobs(
            http, key, "submit", str(image), "-m", "toy", "-p", "exit_code=65", "--wait"
        )
    assert code == 1
    assert "failed" in stdout and "bad input: exit code 65" in stderr


async def test_jobs_list_show_cancel_retry_and_prune(settings, make_key, tmp_path):
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    admin = await make_key("ops", admin=True)
    async with api_client(settings) as http:  # no worker: jobs stay queued
        code, stdout, _ = await gpujobs(http, admin, "submit", str(image), "-m", "toy", "--json")
        assert code == 0
        job_id = json.loads(stdout)["id"]
        code, stdout, _ = await gpujobs(http, admin, "jobs", "list", "--state", "queued", "--json")
        assert code == 0 and [j["id"] for j in json.loads(stdout)["jobs"]] == [job_id]
        code, stdout, _ = await gpujobs(http, admin, "jobs", "show", job_id)
        assert code == 0 and stdout.startswith(f"{job_id}  queued  toy")
        code, stdout, _ = await gpujobs(http, admin, "jobs", "cancel", job_id)
        assert code == 0 and stdout.strip() == f"{job_id}  canceled"
        code, stdout, _ = await gpujobs(http, admin, "jobs", "retry", job_id)
        assert code == 0 and f"{job_id}  queued" in stdout
        code, stdout, _ = await gpujobs(http, admin, "prune", "--older-than", "7d", "--dry-run")
        assert code == 0 and stdout.startswith("would expire 0 jobs")
        assert stdout.rstrip().endswith("0 bytes of files (inputs not counted)")  # as if none were freed

        code, _, stderr = await gpujobs(http, None, "jobs", "list")
        assert code == 2 and "401" in stderr  # the key comes from --key or GPUJOBS_API_KEY
        code, _, stderr = await gpujobs(http, await make_key("user"), "prune")
        assert code == 2 and "403" in stderr  # prune is for admins
        code, _, stderr = await gpujobs(http, admin, "jobs", "show", "not-a-job")
        assert code == 2 and "is not a job id" in stderr  # refused before the request


def test_params_are_typed_like_json():
    from app import cli_submit

    assert cli_submit.parse_params(["a=1", "b=2.5", "c=true", "d=glb", "e=x=y"]) == {
        "a": 1,
        "b": 2.5,
        "c": True,
        "d": "glb",
        "e": "x=y",
    }


def test_a_param_given_twice_is_refused(capsys):
    """`-p width_mm=80 -p width_mm=90` sent 90 without a word; now the command stops, naming it."""
    with pytest.raises(typer.Exit) as caught:
        cli_submit.parse_params(["width_mm=80", "steps=2", " width_mm =90"])
    assert caught.value.exit_code == 2
    assert capsys.readouterr().err == "error: --param 'width_mm' is given 2 times; give it once\n"


def test_server_sent_events_are_parsed():
    from app import cli_submit

    lines = ["retry: 2000", "", "id: 7", "event: state", 'data: {"state": "queued"}', "", ": keepalive", ""]
    assert list(cli_submit.sse(iter(lines))) == [("7", "state", {"state": "queued"})]


def test_durations(tmp_path: Path):
    from app import cli_prune, errors

    assert [cli_prune.parse_duration(t) for t in ("90s", "30S", "15m", "12h", "7d", "2w", "1.5d")] == [
        90, 30, 900, 43_200, 604_800, 1_209_600, 129_600,
    ]  # fmt: skip
    try:
        cli_prune.parse_duration("soon")
    except errors.InvalidRequest as exc:
        assert "not a duration" in exc.message
    else:
        raise AssertionError("accepted 'soon'")


@pytest.mark.parametrize("text", ["30", "7", "0.5"])
def test_a_duration_without_its_unit_is_refused_before_anything_is_deleted(text, capsys):
    """`gpujobs prune --older-than 30`, written as GPUJOBS_RETENTION_DAYS is (a number of days),
    was read as 30 seconds: every result and log of the month before deleted, for good."""
    with pytest.raises(typer.Exit) as caught:  # before any request: nothing listens on port 9
        cli_prune.prune(older_than=text, dry_run=False, url="http://127.0.0.1:9", key=None, as_json=False)
    assert caught.value.exit_code == 2
    said = capsys.readouterr().err
    assert said.startswith(f"error: {text!r} has no unit: write {text}d (days)"), said


def test_the_client_commands_load_no_database_code():
    """`gpujobs jobs list` and the other client commands speak HTTP only. Loading the settings and
    SQLAlchemy with the command cost each of them 0.6 s of CPU before its request went out."""
    loaded = modules_loaded_by("app.cli")
    assert "app.client" in loaded
    assert not {"sqlalchemy", "asyncpg", "pydantic_settings", "app.db", "app.auth"} & loaded


async def test_database_commands_say_why_they_cannot_use_the_database(settings, tmp_path):
    """`serve`, `worker`, `migrate`, `keys` (and `check`) printed a traceback of some 500 lines, and exited 1,
    when the database was down or the URL named a database that does not exist. Now one line
    (docs/operations.md); `migrate` printed seven of Alembic's plugin lines before it."""
    from sqlalchemy.engine import make_url

    from tests.conftest import free_port, worker_env

    refused = "postgresql+asyncpg://gpujobs:hunter2@127.0.0.1:9/jobs"
    missing = make_url(settings.database_url).set(database="no_such_db").render_as_string(hide_password=False)
    cases = [
        (refused, ["keys", "list"], "cannot reach the database"),
        (refused, ["keys", "create", "alice"], "cannot reach the database"),
        (refused, ["migrate"], "cannot reach the database"),
        (refused, ["worker", "--burst"], "cannot reach the database"),
        (refused, ["serve", "--no-worker", "--port", str(free_port())], "cannot reach the database"),
        (missing, ["keys", "list"], 'database "no_such_db" does not exist'),
        (missing, ["migrate"], 'database "no_such_db" does not exist'),
        (refused, ["check"], "cannot reach the database"),
        (missing, ["check"], 'database "no_such_db" does not exist'),
    ]
    (settings.storage_dir / "results").mkdir(parents=True)  # `check` looks for it first
    for url, args, why in cases:
        env = {**worker_env(settings, "cli"), "GPUJOBS_DATABASE_URL": url}
        code, _, stderr = await run_cli(env, *args, timeout_s=120)
        assert code == 2, (args, stderr[-2000:])
        assert "Traceback" not in stderr and "─" not in stderr, (args, stderr[-2000:])  # nor rich's
        [line] = stderr.splitlines()
        assert line.startswith("error:") and why in line and "hunter2" not in stderr, (args, line)
        assert make_url(url).render_as_string(hide_password=True).split("@")[-1] in line, line


class Unavailable:
    """ASGI middleware answering the first `n` GETs of a job stream 503 with Retry-After, as the
    API does while its database is away (and a load balancer while the API restarts)."""

    def __init__(self, app: Any, n: int) -> None:
        self.app, self.left = app, n

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/stream") and self.left > 0:
            self.left -= 1
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"detail": "database unavailable"}'})
            return
        await self.app(scope, receive, send)


async def test_submit_wait_rides_out_a_503_from_the_stream(settings, make_key, tmp_path):
    """The job was accepted and runs: a 503 on its stream (the database away for a moment, with
    Retry-After) made `submit --wait` give up at once, exit 2, without the results."""
    from app.api.main import create_app
    from tests.conftest import http_client, serving

    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    key = await make_key("cli-user")
    app = create_app(settings.model_copy(update={"run_worker": True}))
    app.add_middleware(Unavailable, n=2)
    async with serving(app) as base, http_client(base, key) as http:
        code, stdout, stderr = await gpujobs(
            http, key, "submit", str(image), "-m", "toy", "-p", "sleep=0.5", "--wait", "--out", str(tmp_path)
        )
    assert code == 0, stderr
    assert "succeeded" in stdout and (tmp_path / "in" / "out.txt").exists()
    assert stderr.count("503") == 2 and "retrying" in stderr


async def test_an_answer_that_is_not_the_apis_is_an_error_not_a_traceback(settings, make_key, tmp_path):
    """`--url` pointing at the web page (or any server that answers HTML) crashed the client with a
    JSONDecodeError traceback and exit code 1."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    key = await make_key("cli-user")
    async with api_client(settings) as http:
        code, stdout, _ = await gpujobs(http, key, "submit", str(image), "-m", "toy", "--json")
        job_id = json.loads(stdout)["id"]
        http.base_url = http.base_url.join("/ui/")  # the web page's pages, not the API
        code, stdout, stderr = await gpujobs(http, key, "jobs", "show", job_id)
    assert code == 2 and "Traceback" not in stderr and key not in stderr, stderr[-2000:]
    assert "not the API" in stderr and "--url" in stderr, stderr


async def test_submit_refuses_an_out_that_is_a_file_before_it_uploads(settings, make_key, tmp_path):
    """`--out` naming a file was found out only after the job had run, by a FileExistsError
    traceback (exit 1), with the job's results left on the server."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    taken = tmp_path / "results.txt"
    taken.write_text("mine")
    key = await make_key("cli-user")
    async with api_client(settings, run_worker=True) as http:
        code, _, stderr = await gpujobs(http, key, "submit", str(image), "-m", "toy", "--out", str(taken))
        listed = (await http.get("/jobs")).json()["jobs"]
    assert code == 2 and "Traceback" not in stderr and "results.txt" in stderr, stderr[-2000:]
    assert listed == [] and taken.read_text() == "mine"  # nothing was submitted


async def test_what_the_client_prints_is_printed_as_it_is_not_read_as_markup(settings, make_key, tmp_path):
    """The client printed its errors through rich's markup: a message with `[/x]` in it (a model
    name, the server's detail, a job's error with a path in brackets) crashed it with a MarkupError
    traceback, and `[warn]` vanished from the text."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    key = await make_key("cli-user")
    async with api_client(settings) as http:
        for model in ("[/x]", "[warn] mesh"):
            code, _, stderr = await gpujobs(http, key, "submit", str(image), "-m", model)
            assert code == 2 and "Traceback" not in stderr, stderr[-2000:]
            assert model in stderr, stderr


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("GPUJOBS_URL", "http://127.0.0.1:800o"),
        ("GPUJOBS_URL", "http://h:8000:8000"),
        ("GPUJOBS_API_KEY", "gpj_…"),
    ],
    ids=["a port that is no number", "two ports", "a key with a character that is not ASCII"],
)
async def test_a_bad_url_or_key_is_an_error_not_a_traceback(setting, value):
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), "COLUMNS": "400"}
    env |= {"GPUJOBS_URL": "http://127.0.0.1:9", setting: value}
    code, _, stderr = await run_cli(env, "jobs", "list")
    assert code == 2 and "Traceback" not in stderr and stderr.startswith("error:"), stderr[-2000:]
    assert ("--url" if setting == "GPUJOBS_URL" else "--key") in stderr, stderr


async def test_results_that_cannot_be_written_are_an_error_not_a_traceback(settings, make_key, tmp_path):
    """`--out` in a place no folder can be made (here /proc) failed after the job had run with an
    OSError traceback, exit code 1."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    key = await make_key("cli-user")
    async with api_client(settings, run_worker=True) as http:
        code, _, stderr = await gpujobs(
            http, key, "submit", str(image), "-m", "toy", "--out", "/proc/gpujobs-out"
        )
    assert code == 2 and "Traceback" not in stderr and "/proc/gpujobs-out" in stderr, stderr[-2000:]


async def test_a_failed_download_prints_the_servers_reason(
    settings, manager, make_worker, engine, tmp_path, capsys
):
    """A download the server refused printed only its status ("download of out.txt answered
    410"), not why. Now the server's `detail` too (here: retention deleted the files)."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["files"][0]["url"]
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE jobs SET expired_at = now() WHERE id = :id"), {"id": job_id})

        def download() -> None:
            with httpx.Client(base_url=str(http.base_url)) as sync, pytest.raises(typer.Exit):
                cli_submit.download(sync, url, out / "out.txt")

        await asyncio.to_thread(download)
    printed = capsys.readouterr().err
    assert "download of out.txt answered 410" in printed and "deleted by retention" in printed, printed
    assert not list(out.iterdir())  # nor a partial file left


async def test_a_job_id_that_is_not_a_uuid_is_refused_before_any_request(settings, make_key):
    """Job ids went into the URL as given: `jobs show ../models` asked GET /models and crashed
    (KeyError: 'state'), `jobs cancel '../admin/prune#'` sent POST /admin/prune, `jobs show ''`
    said the server "answered 307". A job id is a UUID: anything else is one line, exit 2."""
    key = await make_key("ids", admin=True)
    async with api_client(settings) as http:
        for args in (
            ["jobs", "show", "../models"],
            ["jobs", "show", ""],
            ["jobs", "cancel", "../admin/prune#"],
            ["jobs", "retry", "../../models"],
        ):
            code, stdout, stderr = await gpujobs(http, key, *args)
            assert code == 2 and stdout == "", (args, stderr)
            assert stderr == f"error: {args[2]!r} is not a job id (a UUID, as `gpujobs jobs list` shows)\n", (
                stderr
            )
        job_id = "0b0d6a5e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"
        code, _, stderr = await gpujobs(http, key, "jobs", "show", job_id.upper())
        assert code == 2 and stderr.startswith("error: 404: "), stderr  # a UUID reaches the server


@pytest.mark.parametrize("text", ["1" + "0" * 400 + "s", "1" + "0" * 400 + "w", "9" * 308 + "w"])
def test_a_duration_too_large_for_a_number_is_refused(text, capsys):
    """`prune --older-than 1000…0` (400 zeros) crashed with `ValueError: Out of range float values
    are not JSON compliant`; a finite value past the server's bound gets the server's 422."""
    with pytest.raises(typer.Exit) as caught:
        cli_prune.prune(older_than=text, dry_run=True, url="http://127.0.0.1:9", key=None, as_json=False)
    assert caught.value.exit_code == 2
    assert (
        capsys.readouterr().err
        == f"error: {text!r} is longer than any duration (examples: 90s, 12h, 7d, 2w)\n"
    )


@contextlib.contextmanager
def other_server(folder: Path) -> Iterator[str]:
    """A web server that is not the API (Python's http.server serving `folder`): its URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline and process.poll() is None, "http.server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


async def test_a_server_that_is_not_the_api_is_said_in_one_line(tmp_path):
    """Another web server's error page was printed whole after `error: 404:` (many lines of HTML),
    and a JSON answer of another shape (`{"status": "ok"}` at /jobs) crashed `jobs list` with a
    KeyError traceback and exit code 1, which means "the job failed"."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "jobs").write_text('{"status": "ok"}')
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
    env["GPUJOBS_API_KEY"] = "k"
    with other_server(site) as url:
        env["GPUJOBS_URL"] = url
        for args in (["jobs", "list"], ["jobs", "show", str(uuid.uuid4())], ["jobs", "list", "--json"]):
            code, _, stderr = await run_cli(env, *args)
            assert code == 2 and "Traceback" not in stderr, (args, stderr[-2000:])
            [line] = stderr.splitlines()
            assert "not the API" in line and "--url" in line, (args, line)


async def test_jobs_list_pages_with_the_cursor_it_prints(settings, make_key, tmp_path):
    """`jobs list` showed the first page (200 jobs at most) and no way past it: the API's cursor
    had no option, and nothing said more jobs were there."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    key = await make_key("pager")
    async with api_client(settings) as http:
        ids = []
        for _ in range(3):
            code, stdout, _ = await gpujobs(http, key, "submit", str(image), "-m", "toy", "--json")
            ids.append(json.loads(stdout)["id"])
        code, stdout, stderr = await gpujobs(http, key, "jobs", "list", "--limit", "2")
        assert code == 0 and [line.split()[0] for line in stdout.splitlines()] == ids[:0:-1], stdout
        [hint] = [line for line in stderr.splitlines() if "--cursor" in line]
        cursor = hint.split("--cursor ")[1].split()[0]
        code, stdout, stderr = await gpujobs(http, key, "jobs", "list", "--limit", "2", "--cursor", cursor)
        assert code == 0 and [line.split()[0] for line in stdout.splitlines()] == ids[:1], stdout
        assert "--cursor" not in stderr  # the last page says nothing more


class _EndedWhileAway(http.server.BaseHTTPRequestHandler):
    """A stand-in for the API: a job whose stream breaks after a running event, and answers 204
    (the job ended, Last-Event-ID was its last event) when followed again; then the job, succeeded."""

    job_id = str(uuid.uuid4())
    streams = 0

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _job(self, state: str) -> dict[str, Any]:
        return {
            "id": self.job_id, "state": state, "model": "toy", "attempt": 1, "max_attempts": 3,
            "priority": 0, "created_at": "2026-11-27T00:00:00Z", "progress": 1.0, "files": [],
        }  # fmt: skip

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._json(201, self._job("queued"))

    def do_GET(self) -> None:
        if not self.path.endswith("/stream"):
            self._json(200, self._job("succeeded"))
            return
        type(self).streams += 1
        if type(self).streams > 1:
            self.send_response(204)
            self.end_headers()
            return
        event = b'id: 7\nevent: state\ndata: {"state": "running", "attempt": 1, "progress": 0.5}\n\n'
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(event)

    def log_message(self, *args: Any) -> None:
        pass


async def test_a_stream_that_answers_204_when_followed_again_ends_the_wait(tmp_path):
    """The stream answers 204 to a Last-Event-ID that was its job's last event. The client took it
    for a refusal: `error: 204:` and exit code 2, for a job that had succeeded."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EndedWhileAway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
    env |= {"GPUJOBS_URL": f"http://127.0.0.1:{server.server_address[1]}", "GPUJOBS_API_KEY": "k"}
    try:
        code, stdout, stderr = await run_cli(env, "submit", str(image), "-m", "toy", "--wait")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert _EndedWhileAway.streams == 2 and stdout.startswith(f"{_EndedWhileAway.job_id}  succeeded"), stdout


async def test_retry_many_says_how_many_it_left_and_why(settings, manager, engine, make_key):
    """The bulk retry now stops at the queue limit and answers how many matching jobs it left; the
    command said only how many it retried, and an operator took a partial retry for a whole one."""
    await enqueue(manager, vram_mb=40_000)  # waits: the queue is full with it
    failed = await enqueue(manager, vram_mb=40_000)
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET state = 'failed', attempt = 1, finished_at = now() WHERE id = :id"),
            {"id": failed},
        )
    admin = await make_key("ops", admin=True)
    async with api_client(settings, queue_limit=1) as http:
        code, stdout, stderr = await gpujobs(http, admin, "jobs", "retry-many", "--json")
        assert code == 0 and json.loads(stdout) == {
            "retried": 0,
            "left": 1,
            "unserved": 0,
            "queue_full": True,
        }, stderr
        code, stdout, stderr = await gpujobs(http, admin, "jobs", "retry-many")
    assert code == 0, stderr
    assert stdout.strip() == (
        "retried 0 jobs; 1 left: the queue is full (GPUJOBS_QUEUE_LIMIT); run this again once it has room"
    )


async def test_jobs_cancel_and_retry_many_by_filter(settings, make_key, tmp_path):
    """The bulk cancel and the bulk retry had routes but no command: an operator clearing the jobs
    of a model dropped from the registry wrote the JSON and the curl by hand."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    admin = await make_key("ops", admin=True)
    async with api_client(settings) as http:  # no worker: jobs stay queued
        ids = []
        for _ in range(2):
            code, stdout, _ = await gpujobs(http, admin, "submit", str(image), "-m", "toy", "--json")
            assert code == 0
            ids.append(json.loads(stdout)["id"])
        code, _, stderr = await gpujobs(http, admin, "jobs", "cancel-many")
        assert code == 2 and "--all" in stderr  # no filter: refused before any request
        code, stdout, stderr = await gpujobs(http, admin, "jobs", "cancel-many", "--model", "toy")
        assert code == 0, stderr
        assert stdout.strip() == "canceled 2 jobs; 0 running jobs asked to stop"
        states = {(await http.get(f"/jobs/{job_id}")).json()["state"] for job_id in ids}
        assert states == {"canceled"}
        code, stdout, stderr = await gpujobs(http, admin, "jobs", "retry-many", "--model", "toy", "--json")
        assert code == 0, stderr
        assert json.loads(stdout) == {
            "retried": 0,
            "left": 0,
            "unserved": 0,
            "queue_full": False,
        }  # canceled: one by one
        code, stdout, stderr = await gpujobs(http, admin, "jobs", "retry-many", "--model", "toy")
        assert code == 0 and stdout.strip() == "retried 0 jobs; none left", stderr
        code, stdout, stderr = await gpujobs(http, admin, "jobs", "cancel-many", "--all", "--json")
        assert code == 0 and json.loads(stdout) == {"canceled": 0, "stopping": 0, "left": 0}, stderr


def test_a_result_written_meanwhile_by_another_job_is_not_replaced(tmp_path):
    """The download was put in place with os.replace: a file of that name written by another
    `submit` after the folder was checked was replaced without a word. It is kept (FileExistsError,
    said as exit 2 by `download`) unless --force."""
    theirs, partial = tmp_path / "mesh.glb", tmp_path / ".mesh.glb.partial"
    theirs.write_text("theirs")
    partial.write_text("mine")
    with pytest.raises(FileExistsError):
        cli_submit._put_in_place(partial, theirs, replace=False)
    assert theirs.read_text() == "theirs"
    cli_submit._put_in_place(partial, theirs, replace=True)
    assert theirs.read_text() == "mine" and not partial.exists()


def _cli_env(tmp_path: Path, url: str, key: str = "k") -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "COLUMNS": "400"}
    return env | {"GPUJOBS_URL": url, "GPUJOBS_API_KEY": key}


@pytest.mark.parametrize("key", ["gpj_secret123\r", "gpj_secret123\n", "gpj_sec ret123", "gpj_secret123\x1b"])
async def test_a_key_with_a_line_end_or_a_control_character_is_refused_and_not_shown(key, tmp_path):
    """A key read from a file with Windows line ends kept its `\\r`: httpx refused the header, and
    the client said it "cannot reach" the server, printing the whole key in the message; a key
    with another control character got the server's 400, read as "not the API"."""
    code, _, stderr = await run_cli(_cli_env(tmp_path, "http://127.0.0.1:9", key), "jobs", "list")
    assert code == 2 and "Traceback" not in stderr and stderr.startswith("error:"), stderr[-2000:]
    assert "--key" in stderr and "secret" not in stderr and "cannot reach" not in stderr, stderr


async def test_submit_refuses_an_out_below_a_file_before_it_uploads(settings, make_key, tmp_path):
    """`--out afile/sub` (afile a file) uploaded the image and ran the job, then failed to make
    the folder, with the job's results left on the server."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    (tmp_path / "afile").write_text("mine")
    key = await make_key("cli-user")
    async with api_client(settings, run_worker=True) as http:
        out = str(tmp_path / "afile" / "sub")
        code, _, stderr = await gpujobs(http, key, "submit", str(image), "-m", "toy", "--out", out)
        listed = (await http.get("/jobs")).json()["jobs"]
    assert code == 2 and "Traceback" not in stderr and "afile" in stderr, stderr[-2000:]
    assert listed == []  # nothing was submitted


async def test_an_image_that_cannot_be_read_is_an_error_not_a_traceback(tmp_path):
    """An image whose read fails (EIO: a failing disk, a network file system; here /proc/self/mem)
    ended the command in a traceback, exit 1; a FIFO in its place waited for ever."""
    fifo = tmp_path / "in.png"
    os.mkfifo(fifo)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EndedWhileAway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = _cli_env(tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        for image in ("/proc/self/mem", str(fifo)):
            code, _, stderr = await run_cli(env, "submit", image, "-m", "toy", timeout_s=30)
            assert code == 2 and "Traceback" not in stderr and stderr.startswith("error:"), stderr[-2000:]
            assert image in stderr, stderr
    finally:
        server.shutdown()
        server.server_close()


class _StallsMidFile(_EndedWhileAway):
    """The same stand-in, whose job has one result, sent half and then not at all."""

    def _job(self, state: str) -> dict[str, Any]:
        files = [{"name": "mesh.glb", "url": f"/files/{self.job_id}/mesh.glb", "bytes": 1 << 20}]
        return {**super()._job(state), "files": files}

    def do_GET(self) -> None:
        if self.path.endswith("/stream"):
            self.send_response(204)
            self.end_headers()
        elif self.path.startswith("/files/"):
            self.send_response(200)
            self.send_header("Content-Type", "model/gltf-binary")
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            self.wfile.write(bytes(1 << 19))
            self.wfile.flush()
            time.sleep(30)
        else:
            self._json(200, self._job("succeeded"))


async def test_sigterm_during_a_download_leaves_no_partial_file(tmp_path):
    """`submit --out` killed by SIGTERM (kill, systemd, a CI job's timeout) while it downloaded
    left `.mesh.glb.….partial`, which the next run then refused as an earlier job's results."""
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StallsMidFile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = _cli_env(tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
    out = tmp_path / "out"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", "submit", str(image), "-m", "toy", "--out", str(out),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not any(p.stat().st_size for p in out.glob("in/.mesh.glb.*.partial")):
            assert time.monotonic() < deadline and process.returncode is None, "no download began"
            await asyncio.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.stderr is not None
        stderr = (await asyncio.wait_for(process.stderr.read(), 10)).decode()
        assert await asyncio.wait_for(process.wait(), 10) == 128 + signal.SIGTERM, stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        server.shutdown()
        server.server_close()
    assert "Traceback" not in stderr, stderr[-2000:]
    assert list((out / "in").iterdir()) == []
