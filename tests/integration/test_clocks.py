"""Times and clocks: what a host's time zone, or the database server's, does to the times we show."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy.engine import make_url

from app import logs
from tests import dbadmin
from tests.conftest import api_client
from tests.integration.test_observability import capture
from tests.integration.test_worker import enqueue


async def test_a_retry_time_in_a_jobs_history_is_utc_whatever_the_servers_zone(
    server_url, database_url, settings, manager, make_worker
):
    """A PostgreSQL server in another zone (initdb takes the host's: `timezone` in
    postgresql.conf) wrote the `run_after` of a `retry_scheduled` event in that zone
    ("...+05:30"), where every other time the API answers is in UTC."""
    name = make_url(database_url).database
    await dbadmin.admin(server_url, f"ALTER DATABASE {name} SET timezone = 'Asia/Kolkata'")
    job_id = await enqueue(manager, exit_code=3, max_attempts=2)
    await make_worker(retry_base_s=600, retry_max_s=600).run()  # scheduled in 10 minutes
    async with api_client(settings) as http:
        job = (await http.get(f"/jobs/{job_id}")).json()
        events = (await http.get(f"/jobs/{job_id}/events")).json()
    [retry] = [e for e in events if e["kind"] == "retry_scheduled"]
    run_after = retry["detail"]["run_after"]
    assert datetime.fromisoformat(run_after).utcoffset() == timedelta(0), run_after
    assert datetime.fromisoformat(run_after) == datetime.fromisoformat(job["next_run_at"])
    assert all(datetime.fromisoformat(e["at"]).utcoffset() == timedelta(0) for e in events), events


def test_a_text_log_line_says_its_time_in_utc_whatever_the_hosts_zone(monkeypatch):
    """A text line began with the host's local time and no zone ("2026-11-26 07:00:00,123"): the
    lines of a worker in New York and of an API in Frankfurt, read side by side, were hours apart
    for the same moment. JSON lines were UTC already."""
    handler, stop = capture(logs.TextFormatter())
    monkeypatch.setenv("TZ", "Etc/GMT+5")  # five hours behind UTC, as New York in winter
    time.tzset()
    try:
        logging.getLogger("gpujobs.clock_test").warning("hello", extra={"action": "demo"})
    finally:
        stop()
        monkeypatch.undo()
        time.tzset()
    [line] = handler.lines
    written = datetime.fromisoformat(line.split(" ", 1)[0])
    assert written.utcoffset() == timedelta(0), line
    assert abs(written - datetime.now(UTC)) < timedelta(seconds=60), line
