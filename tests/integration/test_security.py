"""Who may do what: keys, tenants, links, upload limits, strict params, model hygiene, headers.

Each test fails if the protection it names is removed. Everything runs over real HTTP against a
real PostgreSQL; the model tests run real subprocesses.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from sqlalchemy import text
from sqlalchemy.engine import make_url

from app import auth, errors, links, modelsfile, storage
from app.api import limits, security
from app.settings import Settings
from tests import rawhttp
from tests.conftest import (
    api_client,
    bearer,
    client_for,
    create_key,
    free_port,
    http_client,
    toy_model,
    wait_until_serving,
    worker_env,
)
from tests.integration.test_stream import events, submit_toy

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
out = args["--out"]
with open(os.path.join(out, "probe.json"), "w") as f:
    found = sorted(os.listdir())
    json.dump({"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "found": found}, f)
os.makedirs(os.path.expanduser("~/.cache/probe"), exist_ok=True)  # litter, for the next job to not find
with open(os.path.expanduser("~/.cache/probe/secret"), "w") as f:
    f.write(args["--text"])
size = int(float(args["--size-mb"]) * 1024 * 1024)
if size:
    with open(os.path.join(out, "big.bin"), "wb") as f:
        f.write(b"x" * size)
"""


def probe_model(script: Path) -> str:
    """Registry TOML for `probe`: records its argv, environment and folder; may write a big file."""
    argv = ["{python}", str(script), "--input", "{input}", "--out", "{output_dir}", "--text", "{text}"]
    argv += ["--size-mb", "{size_mb}"]
    return f"""
[models.probe]
description = "Test model: records argv, environment and working folder"
argv = {json.dumps(argv)}
vram = {{ base_mb = 100 }}
timeout_s = 30
max_attempts = 1
[models.probe.params.text]
type = "str"
default = "hello"
[models.probe.params.size_mb]
type = "float"
min = 0
max = 4
default = 0
[[models.probe.outputs]]
name = "probe.json"
media_type = "application/json"
[[models.probe.outputs]]
name = "big.bin"
required = false
max_mb = 1
"""


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """The toy model and the probe model."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    path = tmp_path / "security-models.toml"
    path.write_text(toy_model("toy") + probe_model(script))
    return path


async def submit(
    http: httpx.AsyncClient, image: bytes, model: str = "toy", params: dict[str, Any] | None = None, **kw: Any
) -> httpx.Response:
    """POST /jobs with an image and optional params."""
    data = {"model": model, **({"params": json.dumps(params)} if params is not None else {})}
    return await http.post("/jobs", files={"image": ("a.png", image, "image/png")}, data=data, **kw)


async def counts(engine: Any) -> tuple[int, int]:
    """(jobs, inputs) rows in the database."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(text("SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM inputs)"))
        ).one()
    return int(row[0]), int(row[1])


def operations(app: Any) -> list[tuple[str, str]]:
    """Every (method, path template) in the app's OpenAPI document."""
    schema = app.openapi()
    return [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]


def concrete(path: str, job_id: str) -> str:
    """A path template with its parameters filled in."""
    return path.replace("{job_id}", job_id).replace("{name}", "out.txt")


# -- 1. API keys -------------------------------------------------------------------------------

PUBLIC = {"/healthz", "/readyz", "/files/{job_id}/{name}", "/metrics"}


async def test_every_route_needs_a_key_except_the_public_ones(settings):
    async with api_client(settings, key=None) as anonymous:
        for method, path in operations(anonymous.app):
            response = await anonymous.request(method, concrete(path, str(uuid.uuid4())))
            if path in PUBLIC:
                assert response.status_code != 401, (method, path)
                continue
            assert response.status_code == 401, (method, path, response.status_code)
            assert response.headers["www-authenticate"].startswith("Bearer"), path
            assert "Authorization: Bearer" in response.json()["detail"]
        # The docs are public by default, and so (tests/integration/test_api_paths.py) is which
        # paths exist: one nobody serves is a 404 without a key.
        assert (await anonymous.get("/openapi.json")).status_code == 200
        assert (await anonymous.get("/docs")).status_code == 200
        assert (await anonymous.get("/no/such/path")).status_code == 404


@pytest.mark.parametrize(
    "header",
    [
        "Bearer nonsense",
        "Bearer gpj_" + "A" * 43,  # well formed, never issued
        "Bearer gpj_" + "A" * 500,  # too long to even hash
        "Bearer gpj_ab cd",
        "Basic YWRtaW46YWRtaW4=",
        "Bearer",
        "gpj_" + "A" * 43,
    ],
)
async def test_bad_keys_are_401(client, header):
    response = await client.get("/jobs", headers={"Authorization": header})
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith('Bearer realm="gpujobs"')
    assert "key" in response.json()["detail"]


@pytest.mark.parametrize("header", ["gpj_" + "A" * 43, "Basic YWRtaW46YWRtaW4=", "Token gpj_x"])
async def test_a_key_sent_without_the_bearer_scheme_is_told_so(client, header):
    """`Authorization: gpj_…` (the key without `Bearer `) was told "missing API key", though a key
    was sent: the user looked for a fault in the key. Now the answer says the scheme is missing."""
    response = await client.get("/jobs", headers={"Authorization": header})
    assert response.status_code == 401
    detail = response.json()["detail"]
    assert detail == security.NO_BEARER and "missing" not in detail
    assert "Authorization: Bearer <key>" in detail
    assert response.headers["www-authenticate"] == 'Bearer realm="gpujobs", error="invalid_request"'


async def test_a_changed_character_makes_a_key_invalid(settings, make_key):
    key = await make_key("alice")
    async with api_client(settings, key=key) as http:
        assert (await http.get("/jobs")).status_code == 200
        flipped = key[:-1] + ("A" if key[-1] != "A" else "B")
        assert (await http.get("/jobs", headers=bearer(flipped))).status_code == 401
        assert (await http.get("/jobs", headers={"Authorization": f"bearer  {key}"})).status_code == 200


async def test_revoked_key_is_refused_at_once(settings, engine, make_key, png):
    key = await make_key("alice")
    async with api_client(settings, key=key) as http:
        assert (await submit(http, png())).status_code == 201
        await auth.KeyStore(engine).revoke(key[: auth.SHOWN_CHARS])
        refused = await http.get("/jobs")
        assert refused.status_code == 401
        assert 'error="invalid_token"' in refused.headers["www-authenticate"]
        assert (await submit(http, png(color=(1, 2, 3)))).status_code == 401
    assert (await counts(engine))[0] == 1


def multipart(image: bytes, model: str = "toy") -> tuple[bytes, str]:
    """A POST /jobs body of `image` for `model`, and its content type."""
    boundary = "gpujobs-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{model}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()
    return head + image + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def test_a_key_revoked_while_its_upload_arrives_queues_nothing(settings, engine, make_key, png):
    """The key was checked before the body, and never again: an upload takes minutes on a slow
    link (20 MB at the minimum rate, 43), and one whose leaked key was revoked meanwhile still had
    its job queued and run. Now the job's statement checks the key, and the answer is 401."""
    key = await make_key("mallory")
    body, content_type = multipart(png())
    revoked = asyncio.Event()

    async def half_then_the_rest() -> AsyncIterator[bytes]:
        yield body[: len(body) // 2]
        await revoked.wait()
        yield body[len(body) // 2 :]

    async with api_client(settings, key=key) as http:
        upload = asyncio.create_task(
            http.post("/jobs", content=half_then_the_rest(), headers={"Content-Type": content_type})
        )
        await asyncio.sleep(0.3)
        await auth.KeyStore(engine).revoke(key[: auth.SHOWN_CHARS])
        revoked.set()
        answer = await upload
    assert answer.status_code == 401, answer.text
    assert await counts(engine) == (0, 0)  # no job, no image


async def test_a_stream_ends_once_its_key_is_revoked(settings, engine, make_key):
    """A job's event stream opened with a key went on for as long as the job (hours in the queue)
    after the key was revoked: states, progress messages and the final error. It ends at its next
    keepalive now, and asking again is refused."""
    key = await make_key("alice")
    async with api_client(settings, stream_keepalive_s=0.3) as admin, client_for(admin, key) as alice:
        job_id = await submit_toy(alice)  # no worker: it stays queued
        async with alice.stream("GET", f"/jobs/{job_id}/stream") as stream:
            seen = events(stream)
            assert (await anext(seen))["data"]["state"] == "queued"
            await auth.KeyStore(engine).revoke(key[: auth.SHOWN_CHARS])
            async with asyncio.timeout(5):
                after = [event async for event in seen]  # the body ends
        assert after == []
        assert (await alice.get(f"/jobs/{job_id}/stream")).status_code == 401


async def test_keys_are_stored_only_as_a_sha256_hash(engine):
    store = auth.KeyStore(engine)
    made = await store.create("alice")
    assert made.secret.startswith("gpj_") and len(made.secret) >= 4 + 43  # 32 random bytes
    assert made.secret != (await store.create("alice")).secret
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT * FROM api_keys WHERE id = :id"), {"id": made.info.id})).one()
    assert row.key_hash == hashlib.sha256(made.secret.encode()).hexdigest()
    assert made.secret not in json.dumps([str(v) for v in row])
    assert row.prefix == made.secret[:12] and row.role == "user" and row.principal == "alice"
    with pytest.raises(errors.InvalidRequest):
        await store.create("../etc")
    with pytest.raises(errors.InvalidRequest):
        await store.create("")


async def test_last_used_is_written_at_most_once_a_minute(settings, engine, make_key):
    key = await make_key("alice")

    async def last_used() -> Any:
        async with engine.connect() as conn:
            return await conn.scalar(
                text("SELECT last_used_at FROM api_keys WHERE key_hash = :h"), {"h": auth.hash_key(key)}
            )

    assert await last_used() is None
    async with api_client(settings, key=key) as http:
        await http.get("/jobs")
        first = await last_used()
        assert first is not None
        await asyncio.gather(*(http.get("/jobs") for _ in range(5)))
        assert await last_used() == first


async def test_admin_and_user_roles(settings, make_key):
    user = await make_key("alice")
    async with api_client(settings) as admin, client_for(admin, user) as alice:
        for method, path in operations(admin.app):
            if not path.startswith("/admin"):
                continue
            job = str(uuid.uuid4())
            as_user = await alice.request(method, concrete(path, job), json={})
            assert as_user.status_code == 403, (method, path)
            assert as_user.json()["detail"] == "this needs an admin key"
            async with client_for(admin, None) as anonymous:
                assert (await anonymous.request(method, concrete(path, job))).status_code == 401
            as_admin = await admin.request(method, concrete(path, job), json={})
            assert as_admin.status_code not in (401, 403), (method, path)
        assert (await alice.get("/admin/anything")).status_code == 403


async def test_private_docs_and_metrics_need_a_key(settings, make_key):
    user = await make_key("alice")
    async with api_client(settings, public_docs=False, public_metrics=False) as http:
        async with client_for(http, None) as anonymous:
            for path in ("/openapi.json", "/docs", "/metrics"):
                assert (await anonymous.get(path)).status_code == 401, path
        async with client_for(http, user) as alice:
            assert (await alice.get("/openapi.json")).status_code == 200  # docs: any key
            assert (await alice.get("/metrics")).status_code == 403  # metrics: an admin's
        assert (await http.get("/openapi.json")).status_code == 200
        assert (await http.get("/docs")).status_code == 200
        assert (await http.get("/metrics")).status_code not in (401, 403)
    async with api_client(settings, key=None) as anonymous:
        assert (await anonymous.get("/healthz")).status_code == 200
        assert (await anonymous.get("/metrics")).status_code != 401


async def test_openapi_declares_the_bearer_scheme(client):
    schema = (await client.get("/openapi.json")).json()
    assert schema["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schema["components"]["securitySchemes"]["apiKey"]["description"],
    }
    assert {"apiKey": []} in schema["paths"]["/jobs"]["post"]["security"]
    assert "security" not in schema["paths"]["/healthz"]["get"]


async def test_first_start_without_an_admin_key_says_how_to_make_one(settings, caplog):
    """It also says what answers without a key: it named /healthz and /readyz alone, though
    /metrics and the docs are public by default."""
    with caplog.at_level("WARNING", logger="gpujobs.security"):
        async with api_client(settings, key=None, public_docs=False):
            pass
    assert "gpujobs keys create admin --admin" in caplog.text
    assert "except /healthz, /metrics, /readyz, signed links" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpujobs.security"):
        async with api_client(settings):  # an admin key exists now
            pass
    assert "keys create" not in caplog.text


async def test_the_first_run_warning_names_a_command_that_runs_from_here(settings, caplog, monkeypatch):
    """After `make run`, `gpujobs` is not on PATH (it is .venv/bin/gpujobs), yet the warning said
    "Make the first one with: gpujobs keys create admin --admin": copied, it was "command not
    found". It names the command as it runs from the working folder. And with the storage folder
    the service uses: run with GPUJOBS_STORAGE_DIR=/srv/gpujobs, the command as printed made the
    key in the checkout's own embedded database, and the service answered that key 401."""
    import shlex

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with caplog.at_level("WARNING", logger="gpujobs.security"):
        async with api_client(settings, key=None):
            pass
    [said] = [r.getMessage() for r in caplog.records if "Make the first one with: " in r.getMessage()]
    words = shlex.split(said.split("Make the first one with: ")[1])
    assert words[-4:] == ["keys", "create", "admin", "--admin"], words
    assert words[0] == f"GPUJOBS_STORAGE_DIR={settings.storage_dir.resolve()}"  # not the checkout's storage
    program = words[1]
    assert "/" in program and os.access(program, os.X_OK), program  # runnable as typed, from here
    help_ = [program, *words[2:-4], "--help"]
    ran = await asyncio.to_thread(subprocess.run, help_, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and "serve" in ran.stdout, ran.stderr


def _gpujobs(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", "keys", *args],
        env=worker_env(settings, "keys"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_keys_cli_create_list_revoke(settings, engine):
    made = await asyncio.to_thread(_gpujobs, settings, "create", "carol", "--admin")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert re.fullmatch(r"gpj_[A-Za-z0-9_-]{43}", key)
    assert "shown only now" in made.stderr
    identity = await auth.KeyStore(engine).verify(key)
    assert identity.principal == "carol" and identity.admin

    listed = await asyncio.to_thread(_gpujobs, settings, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert row["prefix"] == key[:12] and row["principal"] == "carol" and row["role"] == "admin"
    assert key not in listed.stdout
    table = (await asyncio.to_thread(_gpujobs, settings, "list")).stdout.splitlines()
    assert "created (UTC)" in table[0] and "last used (UTC)" in table[0], table  # no zone was said
    created = datetime.fromisoformat(row["created_at"]).astimezone(UTC).strftime("%Y-%m-%d %H:%M")
    assert created in table[1], table

    # Digits other than ASCII ones: `'²'.isdigit()` is true and int() refused it with a traceback;
    # Arabic-Indic or full-width digits were taken as the id they spell, and revoked that key.
    def spelt(zero: int) -> str:  # the key's id in the digits that start at code point `zero`
        return "".join(chr(zero + int(d)) for d in str(row["id"]))

    for odd in ("\u00b2", spelt(0x660), spelt(0xFF10)):  # ², Arabic-Indic, full-width
        refused = await asyncio.to_thread(_gpujobs, settings, "revoke", odd)
        assert refused.returncode == 2 and "no API key" in refused.stderr, (odd, refused.stderr)
        assert "Traceback" not in refused.stderr
    assert (await auth.KeyStore(engine).verify(key)).principal == "carol"

    revoked = await asyncio.to_thread(_gpujobs, settings, "revoke", str(row["id"]))
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(auth.Unauthorized):
        await auth.KeyStore(engine).verify(key)
    assert json.loads((await asyncio.to_thread(_gpujobs, settings, "list", "--json")).stdout) == []
    bad = await asyncio.to_thread(_gpujobs, settings, "create", "no spaces allowed")
    assert bad.returncode == 2 and "principal" in bad.stderr


# -- 2. Tenants --------------------------------------------------------------------------------


async def test_another_tenant_gets_404_on_everything(settings, make_key, make_worker, png):
    alice_key, bob_key = await make_key("alice"), await make_key("bob")
    async with api_client(settings) as admin, client_for(admin, alice_key) as alice:
        done = (await submit(alice, png())).json()["id"]
        await make_worker().run()
        waiting = (await submit(alice, png(color=(9, 9, 9)), params={"sleep": 1})).json()["id"]
        mine = await alice.get(f"/jobs/{done}")
        assert mine.json()["state"] == "succeeded" and mine.json()["files"]

        async with client_for(admin, bob_key) as bob:
            for job_id in (done, waiting):
                for method, path in operations(admin.app):
                    if "{job_id}" not in path or path.startswith(("/admin", "/files")):
                        continue
                    answer = await bob.request(method, concrete(path, job_id))
                    assert answer.status_code == 404, (method, path, answer.status_code)
                    assert job_id in answer.json()["detail"] or "no job" in answer.json()["detail"]
            assert (await bob.get("/jobs")).json()["jobs"] == []
            for query in ({"state": "queued"}, {"model": "toy"}, {"limit": 200}):
                assert (await bob.get("/jobs", params=query)).json()["jobs"] == []
            # The same Idempotency-Key as alice's never returns alice's job.
            key = {"Idempotency-Key": "same"}
            first = await submit(alice, png(color=(5, 5, 5)), headers=key)
            other = await submit(bob, png(color=(5, 5, 5)), headers=key)
            assert first.status_code == other.status_code == 201
            assert first.json()["id"] != other.json()["id"]

        assert (await alice.get(f"/jobs/{waiting}")).json()["state"] == "queued"  # bob's cancel did nothing
        assert (await alice.post(f"/jobs/{done}/cancel")).status_code == 409  # the owner learns the state
        assert {done, waiting} <= {j["id"] for j in (await admin.get("/jobs")).json()["jobs"]}
        assert (await admin.get(f"/jobs/{done}/input")).status_code == 200


# -- 3. Signed links ---------------------------------------------------------------------------


async def test_links_only_name_files_of_the_job_inside_storage(settings, make_worker, png, store, tmp_path):
    async with api_client(settings) as http:
        job_id = (await submit(http, png())).json()["id"]
        await make_worker().run()
        job = (await http.get(f"/jobs/{job_id}")).json()
        signer: links.LinkSigner = http.app.state.services.signer
        uid = uuid.UUID(job_id)
        names = ["../../link_secret", "/etc/passwd", "..", ".", "out.txt/../../../link_secret"]
        names += ["attempt-0.log", "attempt-2.log", "attempt-1.log/../x", "probe.json", "%2e%2e"]
        names += ["attempt-1.log\n"]  # `$` matches before a final line break: was the log, renamed
        for name in names:
            answer = await http.get(signer.url(uid, name))  # a valid signature, a bad name
            assert answer.status_code == 404, name
        assert (await http.get(job["files"][0]["url"])).status_code == 200

        secret_file = tmp_path / "outside.txt"
        secret_file.write_text("not for download")
        result = store.root / "results" / job_id / "1" / "out.txt"
        result.unlink()
        result.symlink_to(secret_file)
        assert (await http.get(job["files"][0]["url"])).status_code == 404
        folder = store.root / "results" / job_id / "1"
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "out.txt").write_text("outside storage")
        folder.symlink_to(tmp_path / "elsewhere")
        assert (await http.get(job["files"][0]["url"])).status_code == 404
        log = storage.log_file(store.root, uid, 1)
        log.unlink()
        log.symlink_to(tmp_path / "missing.log")  # a link, even one to nothing, is never served
        assert (await http.get(job["links"]["log"])).status_code == 404


async def test_a_link_planted_as_a_folder_inside_storage_is_not_followed(settings, make_worker, png, store):
    """A folder on the way replaced by a link to another folder inside storage/ (one job's results
    folder to another's, a log bucket to a folder of planted logs) passed: only the last part was
    checked for a link, and the target stayed inside the root. Job A's link served job B's file
    under A's ETag. Now 404, also for a link planted after the route found the file."""
    async with api_client(settings) as http:
        a, b, c = [(await submit(http, png(color=(n, n, n)))).json()["id"] for n in (1, 2, 3)]
        await make_worker().run()
        job_a, job_c = [(await http.get(f"/jobs/{job_id}")).json() for job_id in (a, c)]
        results = store.root / "results"
        shutil.rmtree(results / a)
        (results / a).symlink_to(results / b)
        assert (await http.get(job_a["files"][0]["url"])).status_code == 404

        log = storage.log_file(store.root, uuid.UUID(a), 1)
        planted = store.root / "logs" / "planted"
        planted.mkdir()
        shutil.copy(storage.log_file(store.root, uuid.UUID(b), 1), planted / log.name)
        shutil.rmtree(log.parent)
        log.parent.symlink_to(planted)
        assert (await http.get(job_a["links"]["log"])).status_code == 404

        services = http.app.state.services
        resolve = services.store.resolve

        def resolve_then_plant(job: Any, name: str) -> Any:
            found = resolve(job, name)
            shutil.rmtree(results / c)
            (results / c).symlink_to(results / b)
            return found

        services.store.resolve = resolve_then_plant
        assert (await http.get(job_c["files"][0]["url"])).status_code == 404


async def test_downloads_answer_head_and_conditional_requests(settings, make_worker, png):
    """Download tools ask HEAD for the size first, and send If-None-Match: * or a weak tag."""
    async with api_client(settings) as http:
        job_id = (await submit(http, png())).json()["id"]
        await make_worker().run()
        job = (await http.get(f"/jobs/{job_id}")).json()
        url, log = job["files"][0]["url"], job["links"]["log"]
        whole = await http.get(url)
        head = await http.head(url)
        assert head.status_code == 200, head.text
        assert head.content == b"" and head.headers["content-length"] == str(len(whole.content))
        assert head.headers["etag"] == whole.headers["etag"] and head.headers["accept-ranges"] == "bytes"
        assert (await http.head(log)).status_code == 200
        for tags in ("*", f"W/{whole.headers['etag']}", f'"other", {whole.headers["etag"]}'):
            assert (await http.get(url, headers={"If-None-Match": tags})).status_code == 304, tags
        assert (await http.get(url, headers={"If-None-Match": '"other"'})).status_code == 200
        tampered = url.replace("sig=", "sig=x")
        assert (await http.head(tampered)).status_code == 403


async def test_link_signature_binds_job_name_and_expiry(settings):
    signer = links.LinkSigner(b"k" * 32, ttl_s=60)
    job, other = uuid.uuid4(), uuid.uuid4()
    url = signer.url(job, "out.txt", now=1000)
    exp = int(re.search(r"exp=(\d+)", url).group(1))  # type: ignore[union-attr]
    sig = re.search(r"sig=([^&]+)", url).group(1)  # type: ignore[union-attr]
    signer.verify(job, "out.txt", exp, sig, now=1000)
    for args in ((other, "out.txt", exp), (job, "out.glb", exp), (job, "out.txt", exp + 1)):
        with pytest.raises(errors.Forbidden):
            signer.verify(*args, sig, now=1000)
    with pytest.raises(errors.Forbidden, match="expired"):
        signer.verify(job, "out.txt", exp, sig, now=exp + 1)
    with pytest.raises(errors.Forbidden):
        links.LinkSigner(b"x" * 32, ttl_s=60).verify(job, "out.txt", exp, sig, now=1000)
    for bad in ("", "é" * 43, sig[:-1], sig + "A", "\x00" * 43):  # found by the fuzz test: was a 500
        with pytest.raises(errors.Forbidden):
            signer.verify(job, "out.txt", exp, bad, now=1000)


def test_processes_that_start_together_read_one_whole_link_secret(tmp_path):
    """Two API processes starting together on a fresh storage folder (several `serve` processes, or
    one with GPUJOBS_API_PROCESSES): the second could open the file the first had just created,
    before it wrote the secret, and read it empty ("must be at least 16 characters")."""
    import concurrent.futures
    import threading

    for round_ in range(40):
        folder = tmp_path / str(round_)
        start = threading.Barrier(8)

        def read(folder: Path = folder, start: threading.Barrier = start) -> bytes:
            start.wait()
            return links.load_or_create_secret(folder)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            secrets = set(pool.map(lambda _: read(), range(8)))
        assert len(secrets) == 1 and len(secrets.pop()) >= 32, round_


def test_link_secret_is_random_private_and_outside_the_repository(tmp_path):
    one, two = links.load_or_create_secret(tmp_path / "a"), links.load_or_create_secret(tmp_path / "b")
    assert one != two and len(one) >= 32
    assert links.load_or_create_secret(tmp_path / "a") == one  # kept across restarts
    assert stat.S_IMODE((tmp_path / "a" / "link_secret").stat().st_mode) == 0o600
    with pytest.raises(errors.ConfigError):
        links.LinkSigner(b"short", ttl_s=60)
    assert Settings().link_secret is None  # no secret ships with the code
    assert "/storage/*" in (ROOT / ".gitignore").read_text()  # where a generated one lives
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert "link_secret" not in tracked.stdout.split()


def test_a_link_secret_file_too_short_is_named_with_what_to_do(tmp_path):
    """An empty or short storage/link_secret (cut by hand, a copy gone wrong) stopped the start
    with "GPUJOBS_LINK_SECRET must be at least 16 characters", a setting the operator never set.
    Now the error names the file and says to delete it (a new one is made; old links stop working)."""
    path = tmp_path / "link_secret"
    for content in (b"", b"short\n"):
        path.write_bytes(content)
        with pytest.raises(errors.ConfigError) as refused:
            links.LinkSigner(links.load_or_create_secret(tmp_path), ttl_s=60)
        message = refused.value.message
        assert str(path) in message and "delete it" in message and "stop working" in message, message
        assert "GPUJOBS_LINK_SECRET" not in message, message


# -- 4. Upload hardening -----------------------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` but carries almost no data (a decompression bomb's head)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    idat = zlib.compress(b"\0" * 1000)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _bomb() -> bytes:
    """A real, valid 1-bit 10000 x 10000 PNG: 100 megapixels in about 12 KB."""
    buffer = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


async def test_decompression_bombs_are_refused_by_their_header(client, engine):
    bomb = await asyncio.to_thread(_bomb)
    assert len(bomb) < 100_000
    for image in (bomb, _png_header_only(9_000, 9_000), _png_header_only(60_000, 60_000)):
        response = await submit(client, image)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]  # ours, naming the limit, past Pillow's own limit too
        assert "megapixels, over the 64 megapixel limit" in detail, detail
    assert await counts(engine) == (0, 0)


async def test_pixel_limit_is_configurable(settings, png, engine):
    async with api_client(settings, max_image_megapixels=0.01) as http:
        refused = await submit(http, png((200, 100)))
        assert refused.status_code == 422 and "0.01 megapixel limit" in refused.json()["detail"]
        assert (await submit(http, png((50, 50)))).status_code == 201


async def test_corrupt_truncated_and_wrong_type_images(client, png, engine):
    good = png((100, 100))
    corrupt = bytearray(good)
    start = good.index(b"IDAT") + 8
    corrupt[start : start + 40] = bytes(40)
    gif = io.BytesIO()
    Image.new("RGB", (8, 8)).save(gif, format="GIF")
    cases = [
        (bytes(corrupt), 422),
        (good[:-30], 422),
        (good[:40], 422),
        (b"", 422),
        (gif.getvalue(), 415),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", 415),
        (b"%PDF-1.4\n", 415),
    ]
    for image, status in cases:
        response = await submit(client, image)
        assert response.status_code == status, (image[:10], response.text)
        assert response.json()["detail"].startswith("image:")
    assert await counts(engine) == (0, 0)


async def test_per_key_queue_limit_is_429_with_retry_after(settings, make_key, png, engine):
    alice_key, bob_key, second_alice_key = (
        await make_key("alice"),
        await make_key("bob"),
        await make_key("alice"),
    )
    async with api_client(settings, key=alice_key, queue_limit_per_key=2) as alice:
        first = await submit(alice, png(color=(1, 1, 1)), headers={"Idempotency-Key": "k1"})
        assert (await submit(alice, png(color=(2, 2, 2)))).status_code == 201
        full = await submit(alice, png(color=(3, 3, 3)))
        assert full.status_code == 429 and int(full.headers["retry-after"]) > 0
        assert "2 jobs waiting" in full.json()["detail"]
        async with client_for(alice, second_alice_key) as alice_again:  # the principal's keys share it
            assert (await submit(alice_again, png(color=(3, 3, 3)))).status_code == 429
        again = await submit(alice, png(color=(1, 1, 1)), headers={"Idempotency-Key": "k1"})
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        async with client_for(alice, bob_key) as bob:
            assert (await submit(bob, png(color=(4, 4, 4)))).status_code == 201
        await alice.post(f"/jobs/{first.json()['id']}/cancel")
        assert (await submit(alice, png(color=(3, 3, 3)))).status_code == 201
    assert (await counts(engine))[0] == 4


async def test_many_or_huge_form_fields_are_refused_cleanly(client, png, engine):
    image = {"image": ("a.png", png(), "image/png")}
    many = [("model", "toy")] + [(f"f{i}", "x") for i in range(50)]
    response = await client.post("/jobs", files=image, data=dict(many))
    assert response.status_code == 400 and "Too many fields" in response.json()["detail"]
    two_files = [("image", ("a.png", png(), "image/png")), ("other", ("b.png", png(), "image/png"))]
    response = await client.post("/jobs", files=two_files, data={"model": "toy"})
    assert response.status_code == 400 and "Too many files" in response.json()["detail"]
    response = await client.post("/jobs", files=image, data={"model": "toy", "params": "x" * 200_000})
    assert response.status_code == 400 and "maximum size" in response.json()["detail"]
    response = await client.post("/jobs", files=image, data={"model": "toy", "params": " " * 20_000})
    assert response.status_code == 422 and "params" in json.dumps(response.json()["detail"])
    assert await counts(engine) == (0, 0)


async def test_text_postgresql_cannot_store_is_422_not_500(client, png, engine):
    """NUL characters and unpaired surrogates are not text to PostgreSQL: refused, naming the field."""
    listed = await client.get("/jobs", params={"model": "re\x00lief"})
    assert listed.status_code == 422, listed.text
    assert listed.json()["detail"][0]["loc"] == ["query", "model"]
    for body in (
        b'{"error_contains": "out of \\u0000memory"}',
        b'{"error_contains": "\\ud800"}',
        b'{"model": "\\ud800"}',
    ):
        answer = await client.post(
            "/admin/jobs/retry", content=body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 422, (body, answer.text)
        assert json.loads(answer.text)["detail"], body
    assert await counts(engine) == (0, 0)


async def test_a_422_that_echoes_nan_is_still_json(client):
    """A validation error shows the input it refused; NaN and Infinity are no JSON, so they become text."""
    for raw in (b'{"older_than_s": NaN}', b'{"older_than_s": -Infinity, "dry_run": true}'):
        answer = await client.post("/admin/prune", content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 422, answer.text
        [error] = answer.json()["detail"]
        assert error["loc"] == ["body", "older_than_s"] and error["input"] in ("nan", "-inf"), error


async def test_a_422_shows_only_the_start_of_a_long_input(client):
    """A 422 copied back every input it refused, whole: a 20 MB body came back as 20 MB."""
    raw = json.dumps({"older_than_s": "x" * 100_000}).encode()
    answer = await client.post("/admin/prune", content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 422 and len(answer.content) < 1000, answer.text[:300]
    [error] = answer.json()["detail"]
    assert error["input"].startswith("xxxx") and len(error["input"]) <= 101, error
    answer = await client.post("/admin/jobs/retry", json=[{"n": n} for n in range(10_000)])
    assert answer.status_code == 422 and len(answer.content) < 1000, answer.text[:300]


async def test_anonymous_upload_is_refused_before_the_body_is_read(settings):
    async with api_client(settings, key=None) as anonymous:
        sent = 0

        async def body() -> AsyncIterator[bytes]:
            nonlocal sent
            for _ in range(8):
                sent += 1 << 20
                yield b"\0" * (1 << 20)

        headers = {"content-type": "multipart/form-data; boundary=x", "content-length": str(8 << 20)}
        response = await anonymous.post("/jobs", content=body(), headers=headers)
        assert response.status_code == 401


async def _refused_at_once(
    http: httpx.AsyncClient, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[bytes, float, float]:
    """Send a request's head (and `body`) over a raw socket, then wait without sending more, as a
    client does that asked `Expect: 100-continue` or stalls mid-upload. Returns (every byte the
    server sent until it closed, seconds to the first of them, seconds to the close)."""
    reader, writer = await asyncio.open_connection(http.base_url.host, http.base_url.port)
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {http.base_url.host}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    started = time.monotonic()
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    try:
        received, first_s = await rawhttp.collect(reader, started)
        return received, first_s, time.monotonic() - started
    finally:
        writer.close()


UPLOAD = {"Content-Type": "multipart/form-data; boundary=b"}
# A client that asks before sending 50 MB and waits; one that declares 1 GB, sends 5 bytes and stalls.
WAITING = ({**UPLOAD, "Content-Length": str(50 << 20), "Expect": "100-continue"}, b"")
STALLED = ({**UPLOAD, "Content-Length": str(1_000_000_000)}, b"--b\r\n")


@pytest.mark.parametrize("client", [WAITING, STALLED], ids=["expect-100", "stalled"])
@pytest.mark.parametrize(
    ("who", "path", "status"),
    [
        (None, "/jobs", 401),
        ("bad key", "/jobs", 401),
        ("cookie", "/jobs", 403),  # a session cookie without X-Requested-With
        ("user", "/admin/jobs/retry", 403),
        ("admin", "/jobs", 413),
    ],
)
async def test_a_refusal_before_the_body_is_answered_at_once_without_inviting_it(
    settings, make_key, client, who, path, status
):
    """Refusals read the body first: a client waiting on `Expect: 100-continue` (curl) was sent
    100 Continue, then its upload was read (up to 16 MB) before the refusal; one that declared
    1 GB and sent a little got no answer at all."""
    headers, body = client
    if who == "bad key":
        headers = {**headers, "Authorization": "Bearer gpj_" + "x" * 43}
    elif who == "cookie":
        headers = {**headers, "Cookie": f"gpujobs_key={await make_key('alice')}"}
    elif who is not None:
        headers = {**headers, "Authorization": f"Bearer {await make_key(who, admin=who == 'admin')}"}
    async with api_client(settings, key=None) as http:
        received, first_s, closed_s = await _refused_at_once(http, path, headers, body)
    head = received.split(b"\r\n\r\n")[0].lower()
    assert received.startswith(f"HTTP/1.1 {status} ".encode()), received[:200]
    assert b" 100 " not in received and b"continue" not in head, received[:200]
    assert b"connection: close" in head, head
    assert first_s < 1.0, f"answered after {first_s:.2f} s"
    assert closed_s < limits.DRAIN_S + 2, f"closed after {closed_s:.2f} s"  # the drain is bounded


@pytest.fixture
def served(settings: Settings, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """`gpujobs serve --no-worker` in its own process; yields (base URL, pid)."""
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    env = worker_env(settings, "serve", link_secret=settings.link_secret, log_level="WARNING")
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--no-worker", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    wait_until_serving(process, base, tmp_path / "serve.log")
    try:
        yield base, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _memory_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


class PeakRss:
    """The largest resident size of a process, sampled every few milliseconds."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kb, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, _memory_kb(self.pid)["VmRSS"])
            time.sleep(0.002)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


HEAD = (
    b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\ntoy\r\n'
    b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
    b"Content-Type: image/png\r\n\r\n"
)
UPLOAD_MB = 500


async def _upload_500_mb(base: str, key: str, *, declare_length: bool) -> int | None:
    """Stream a 500 MB multipart upload, as a careful client does: stop sending once answered.

    A raw HTTP/1.1 client, so the body comes from a loop (nothing is held) and the answer is read
    while sending. Returns the status, or None if the server hung up without one.
    """
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    size = len(HEAD) + (UPLOAD_MB << 20) + 10
    framing = f"Content-Length: {size}" if declare_length else "Transfer-Encoding: chunked"
    writer.write(
        f"POST /jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\n{framing}\r\n\r\n".encode()
    )
    answer = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
    chunk = b"\0" * (1 << 20)
    try:
        for piece in [HEAD, *([chunk] * UPLOAD_MB), b"\r\n--b--\r\n"]:
            writer.write(piece if declare_length else b"%x\r\n%s\r\n" % (len(piece), piece))
            sending = asyncio.ensure_future(writer.drain())
            await asyncio.wait({sending, answer}, return_when=asyncio.FIRST_COMPLETED)
            if answer.done():
                sending.cancel()
                break
            sending.result()
        head = await asyncio.wait_for(answer, 30)
    except ConnectionError:  # the server hung up while we sent: its answer may still be readable
        try:
            head = await asyncio.wait_for(answer, 30)
        except (ConnectionError, asyncio.IncompleteReadError):
            head = b""
    finally:
        answer.cancel()
        writer.close()
    return int(head.split()[1]) if head else None


@pytest.mark.slow
async def test_a_500_mb_upload_barely_moves_the_servers_memory(settings, served, png):
    base, pid = served
    assert settings.database_url
    key = await create_key(settings.database_url, "admin", admin=True)
    async with http_client(base, key) as http:
        for i in range(3):  # warm up: imports, pools, the multipart parser, PIL
            assert (await submit(http, png(color=(i, 0, 0)))).status_code == 201
        assert (await submit(http, b"\0" * (3 << 20))).status_code == 415
    before = _memory_kb(pid)["VmRSS"]
    with PeakRss(pid) as peak:
        refused = [await _upload_500_mb(base, key, declare_length=d) for d in (True, False)]
    # 413 (declared too large: at once; chunked: once past the limit), or None when the server's
    # close overtook its answer while we were still sending (uvicorn does no lingering close).
    assert set(refused) <= {413, None}, refused
    async with http_client(base, key) as http:
        assert len((await http.get("/jobs")).json()["jobs"]) == 3  # nothing was queued
    growth_mb = (peak.peak_kb - before) / 1024
    print(f"server RSS {before / 1024:.1f} MB, peak during two {UPLOAD_MB} MB uploads +{growth_mb:.1f} MB")
    assert growth_mb < 8, f"RSS grew by {growth_mb:.1f} MB"


# -- 5. Strict parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"nope": 1}, "params.nope"),
        ({"steps": "3"}, "params.steps"),
        ({"steps": 2.5}, "params.steps"),
        ({"steps": True}, "params.steps"),
        ({"steps": [1]}, "params.steps"),
        ({"steps": None}, "params.steps"),
        ({"steps": 10**30}, "params.steps"),
        ({"steps": -1}, "params.steps"),
        ({"sleep": 61}, "params.sleep"),
        ({"output": "yes"}, "params.output"),
        ({"signal": "SIGTERM"}, "params.signal"),
        ({"trace": "--output=/etc/passwd"}, "params.trace"),
        ({"trace": "-rf"}, "params.trace"),
        ({"trace": "a\nb"}, "params.trace"),
        ({"trace": "x" * 5000}, "params.trace"),
        ({"trace": "half a pair: \ud800"}, "params"),
    ],
)
async def test_bad_params_are_422_and_name_the_field(client, png, engine, params, field):
    response = await submit(client, png(), params=params)
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith(field + ":"), response.json()
    assert await counts(engine) == (0, 0)


async def test_nan_and_infinity_are_not_numbers(client, png, engine):
    for raw in ('{"sleep": NaN}', '{"sleep": Infinity}', '{"sleep": -Infinity}'):
        response = await client.post(
            "/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "toy", "params": raw}
        )
        assert response.status_code == 422 and response.json()["detail"].startswith("params.sleep")
    assert await counts(engine) == (0, 0)


def test_each_value_is_exactly_one_argv_element(models_file):
    spec = modelsfile.load_registry(models_file).get("probe")
    hostile = "a b; rm -rf / $(id) `id` | cat > x"
    argv = spec.build_argv({"text": hostile}, input_path=Path("/in.png"), output_dir=Path("/out"))
    assert argv[argv.index("--text") + 1] == hostile
    assert len(argv) == len(spec.argv)
    with pytest.raises(errors.InvalidParams):
        spec.build_argv({"text": "--size-mb=4"}, input_path=Path("/in.png"), output_dir=Path("/out"))


# -- 6. Model subprocesses ---------------------------------------------------------------------


async def test_models_run_with_a_minimal_environment_in_their_scratch_folder(
    settings, make_worker, png, monkeypatch, store, tmp_path
):
    monkeypatch.setenv("GPUJOBS_DATABASE_URL", "postgresql://secret-user:secret-pw@db/prod")
    monkeypatch.setenv("GPUJOBS_LINK_SECRET", "link-secret-that-must-not-leak")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    pwned = tmp_path / "pwned"
    hostile = f"a b; echo $(id) > {pwned}"
    async with api_client(settings) as http:
        job_id = (await submit(http, png(), model="probe", params={"text": hostile})).json()["id"]
        await make_worker().run()
        job = (await http.get(f"/jobs/{job_id}")).json()
        assert job["state"] == "succeeded", job["error"]
        probe = (await http.get(job["files"][0]["url"])).json()
    leaked = [v for v in probe["env"].values() if "secret" in v.lower()]
    assert leaked == [] and not any(name.startswith(("GPUJOBS_D", "GPUJOBS_L")) for name in probe["env"])
    assert set(probe["env"]) <= {"PATH", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"} | {
        "PYTHONUNBUFFERED", "HOME", "GPUJOBS_JOB", "GPUJOBS_WORKER", "CUDA_DEVICE_ORDER", "LC_CTYPE",
        "TMP", "TEMP", "GPUJOBS_QUEUE",
    }  # fmt: skip
    assert probe["env"]["GPUJOBS_QUEUE"].endswith("/" + make_url(settings.database_url).database)  # whose job
    scratch = Path(probe["cwd"])
    assert scratch.is_relative_to(store.root / "scratch") and probe["env"]["HOME"] == str(scratch)
    assert [probe["env"][name] for name in ("TMPDIR", "TMP", "TEMP")] == [str(scratch)] * 3
    assert probe["argv"][probe["argv"].index("--text") + 1] == hostile  # one element, no shell
    assert not await asyncio.to_thread(pwned.exists)


async def test_a_scratch_folder_is_emptied_before_the_next_job_uses_it(settings, make_worker, png):
    # One job at a time. A job's slot is handed on while its outcome is written, so the next job
    # may get a second lane; with four jobs the lanes are reused, and each job that lands in a
    # used lane must find nothing of the job before it (its ~/.cache litter, its output).
    async with api_client(settings) as http:
        texts = [f"user {i}'s secret" for i in range(4)]
        jobs = [
            (await submit(http, png(color=(i, 2, 3)), model="probe", params={"text": t})).json()
            for i, t in enumerate(texts)
        ]
        await make_worker(max_jobs_per_gpu=1).run()
        seen = []
        for job in jobs:
            job = (await http.get(f"/jobs/{job['id']}")).json()
            assert job["state"] == "succeeded", job["error"]
            seen.append((await http.get(job["files"][0]["url"])).json())
    lanes = [probe["cwd"] for probe in seen]
    assert len(set(lanes)) < len(lanes), lanes  # a lane took a second job...
    assert all(probe["found"] == ["input.png", "out"] for probe in seen)  # ...holding nothing of the first
    assert os.listdir(settings.storage_dir / "scratch") == []  # a stopped worker leaves no input on disk


async def test_model_output_over_its_size_cap_fails_the_job(settings, make_worker, png):
    async with api_client(settings) as http:
        job_id = (await submit(http, png(), model="probe", params={"size_mb": 2})).json()["id"]
        await make_worker().run()
        job = (await http.get(f"/jobs/{job_id}")).json()
    assert job["state"] == "failed" and "big.bin" in job["error"] and "cap" in job["error"]
    assert job["files"] == []


def test_the_service_never_runs_a_shell():
    forbidden = re.compile(r"shell\s*=\s*True|create_subprocess_shell|os\.system\(|os\.popen\(|\bpty\.spawn")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "app").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert offenders == []


# -- 7. Headers and CORS -----------------------------------------------------------------------


async def test_security_headers_on_every_answer(settings, png):
    async with api_client(settings) as http:
        job_id = (await submit(http, png())).json()["id"]
        answers = {
            "/jobs": await http.get("/jobs"),
            "/healthz": await http.get("/healthz"),
            "401": await http.get("/jobs", headers={"Authorization": "Bearer x"}),
            "404": await http.get(f"/jobs/{uuid.uuid4()}"),
            "input": await http.get(f"/jobs/{job_id}/input"),
        }
        docs = await http.get("/docs")
    for name, answer in answers.items():
        assert answer.headers["x-content-type-options"] == "nosniff", name
        assert answer.headers["x-frame-options"] == "DENY", name
        assert answer.headers["referrer-policy"] == "no-referrer", name
        assert answer.headers["content-security-policy"] == security.API_CSP, name
        assert "strict-transport-security" not in answer.headers  # plain HTTP
    assert answers["/jobs"].headers["cache-control"] == "no-store"
    assert answers["input"].headers["cache-control"].startswith("private")  # the route's own choice
    assert docs.headers["content-security-policy"].startswith("default-src 'none'")
    assert docs.headers["x-frame-options"] == "DENY"


async def test_the_docs_page_loads_nothing_from_another_site_and_has_a_strict_csp(settings):
    """/docs loaded Swagger UI from cdn.jsdelivr.net (a floating major version, no integrity check)
    and ran an inline script with no CSP, on the origin of the web page's session cookie: a changed
    file on the CDN could have acted as any signed-in admin. Now it is a vendored copy, by hash."""
    async with api_client(settings) as http, client_for(http, None) as anonymous:
        docs = await anonymous.get("/docs")
        assert docs.status_code == 200 and "://" not in docs.text, docs.text
        urls = re.findall(r"""(?:src|href)=["']([^"']+)""", docs.text)
        assert len(urls) == 3 and all(u.startswith("/ui/static/") for u in urls), urls
        for url in urls:  # the vendored files, served without a key
            assert (await anonymous.get(url)).status_code == 200, url
        [inline] = re.findall(r"<script>(.*?)</script>", docs.text, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
        policy = dict(d.strip().split(" ", 1) for d in docs.headers["content-security-policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
        assert policy["script-src"].split() == ["'self'", f"'sha256-{digest}'"]
        assert policy["connect-src"] == "'self'"
        assert (await http.get("/redoc")).status_code == 404  # no second page from a CDN either


async def test_cors_allows_only_the_configured_origins(settings):
    allowed, other = "https://app.example.com", "https://evil.example.net"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    async with api_client(settings, cors_origins=f"{allowed}, http://localhost:5173") as http:
        ok = await http.options("/jobs", headers={"Origin": allowed, **preflight})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == allowed
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in ok.headers
        refused = await http.options("/jobs", headers={"Origin": other, **preflight})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        listed = await http.get("/jobs", headers={"Origin": allowed})
        assert listed.headers["access-control-allow-origin"] == allowed
        async with client_for(http, None) as anonymous:  # a page can read why it was refused
            denied = await anonymous.get("/jobs", headers={"Origin": allowed})
            assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == allowed
            assert "WWW-Authenticate" in denied.headers["access-control-expose-headers"]
        elsewhere = await http.get("/jobs", headers={"Origin": other})
        assert "access-control-allow-origin" not in elsewhere.headers
    async with api_client(settings) as http:  # default: no origin at all
        answer = await http.get("/jobs", headers={"Origin": allowed})
        assert "access-control-allow-origin" not in answer.headers


def test_cors_origins_are_checked_at_start():
    assert Settings(cors_origins="https://a.example, http://localhost:3000").cors_origin_list == [
        "https://a.example",
        "http://localhost:3000",
    ]
    for bad in ("https://a.example/path", "a.example", "javascript:alert(1)"):
        with pytest.raises(ValueError, match="origin"):
            Settings(cors_origins=bad)


def test_the_first_key_command_names_the_database_the_service_uses(settings, monkeypatch):
    """The hint's command makes the key where the service looks for it: the checkout's storage
    needs nothing more, another storage folder is named, an external database is asked for
    without its URL (which may hold a password)."""
    from app import checkout

    monkeypatch.delenv("GPUJOBS_DATABASE_URL", raising=False)
    assert security.first_key_command(settings).startswith(
        f"GPUJOBS_STORAGE_DIR={settings.storage_dir.resolve()} "
    )
    default = settings.model_copy(update={"storage_dir": checkout.STORAGE})
    assert security.first_key_command(default).endswith(" keys create admin --admin")
    assert "GPUJOBS_STORAGE_DIR" not in security.first_key_command(default)
    monkeypatch.setenv("GPUJOBS_DATABASE_URL", "postgresql://jobs:s3cret@db/jobs")
    said = security.first_key_command(settings)
    assert said.endswith("keys create admin --admin (with this service's GPUJOBS_DATABASE_URL set)")
    assert "s3cret" not in said and "GPUJOBS_STORAGE_DIR" not in said
