"""The service's own log lines, as the text formatter writes them, for requests over real HTTP."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from sqlalchemy import text

from app import logs
from tests.conftest import api_client, worker_env
from tests.integration.test_observability import capture
from tests.integration.test_stream import submit_toy


async def test_a_request_is_one_text_line_whatever_its_path_holds(settings):
    """The path of a request line is decoded (%0A is a line break, %1B an escape): a client wrote
    a line of its own choosing into the text log ("... ERROR gpujobs.worker: job failed") and could
    send escape sequences to the terminal of whoever read it."""
    handler, stop = capture(logs.TextFormatter())
    forged = "2026-01-01 00:00:00,000 ERROR   gpujobs.worker: database wiped"
    try:
        async with api_client(settings, key=None) as http:
            answer = await http.get(f"/jobs/x%0D%0A{forged.replace(' ', '%20')}%1B[2J")
            assert answer.status_code in (401, 404, 422)
    finally:
        stop()
    [line] = [line for line in handler.lines if "http_request" in line]
    assert "\n" not in line and "\r" not in line and "\x1b" not in line, line
    assert "GET /jobs/x\\r\\n2026-01-01" in line and "\\x1b[2J" in line  # still readable


def test_a_traceback_follows_its_line_and_its_fields():
    """A text line's fields came after the whole traceback, so the line that starts the record
    did not carry them; the traceback itself is kept, below the line."""
    handler, stop = capture(logs.TextFormatter())
    log = logging.getLogger("gpujobs.obs_test")  # (gpujobs.test is made not to propagate)
    try:
        try:
            raise ValueError("broken\nstill broken")
        except ValueError:
            log.exception("it failed", extra={"action": "demo"})
    finally:
        stop()
    [record] = handler.lines
    first, *rest = record.split("\n")
    assert first.endswith("gpujobs.obs_test: it failed  action=demo"), first
    assert rest[0] == "Traceback (most recent call last):" and "ValueError: broken" in rest[-2]


def test_a_database_password_is_masked_however_the_url_gives_it(settings):
    """A password given as the URL's `?password=` (libpq and asyncpg take it there) or after an
    empty user name (`postgresql://:pw@host`) was written out in full by the command that could not
    reach the database, where one after a user name was masked."""
    for url in (
        "postgresql://gpujobs@127.0.0.1:9/gpujobs?password=hunter2",
        "postgresql://:hunter2@127.0.0.1:9/gpujobs",
        "postgresql://gj:hunter2%20x%2B%40@127.0.0.1:9/gpujobs",  # a space: it was printed whole
        "postgresql://g%20j:hunter2@127.0.0.1:9/gpujobs",
    ):
        env = {**worker_env(settings, "masked"), "GPUJOBS_DATABASE_URL": url}
        done = subprocess.run(
            [sys.executable, "-m", "app", "keys", "list"], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and "cannot reach the database" in done.stderr, done.stderr
        assert "hunter2" not in done.stderr and "***" in done.stderr, done.stderr


def test_mask_covers_passwords_keys_and_link_signatures_in_any_message():
    line = logs.mask(
        "postgres://:pw1@db/x postgresql://u@db/x?password=pw2&sslpassword=pw3 "
        "/files/j/mesh.glb?exp=1700000000&sig=c2lnbmF0dXJl gpj_abcdefghijkl "
        "postgresql+asyncpg://u:pw4 with+space@db:5432/x"
    )
    secrets = ("pw1", "pw2", "pw3", "c2lnbmF0dXJl", "abcdefgh", "pw4", "with+space")
    assert not any(secret in line for secret in secrets), line
    assert "postgresql+asyncpg://u:***@db:5432/x" in line
    assert "password=***" in line and "sig=***" in line and "exp=1700000000" in line


async def test_the_traceback_of_a_500_carries_the_request_id(settings, engine):
    """The traceback of an error no handler answers was written by uvicorn, outside the request's
    log context: without its request_id, an operator could not find it from the client's
    X-Request-ID (which that 500 did not even echo). Here a read of `jobs` waits on a lock past
    the server's lock_timeout."""
    async with engine.begin() as conn:
        name = await conn.scalar(text("SELECT current_database()"))
        await conn.execute(text(f'ALTER DATABASE "{name}" SET lock_timeout = 200'))
    handler, stop = capture(logs.JsonFormatter())
    try:
        async with api_client(settings) as http, engine.connect() as locker:
            job_id = await submit_toy(http)
            await locker.execute(text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
            answer = await http.get(f"/jobs/{job_id}", headers={"X-Request-ID": "req-500"})
            await locker.rollback()
    finally:
        stop()
    assert answer.status_code == 500 and answer.headers["x-request-id"] == "req-500", answer.headers
    lines = [json.loads(line) for line in handler.lines]
    [error] = [e for e in lines if e.get("action") == "http_error"]
    assert error["request_id"] == "req-500" and error["route"] == "/jobs/{job_id}", error
    assert "LockNotAvailableError" in error["exception"], error
