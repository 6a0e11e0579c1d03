"""`gpujobs jobs list|show|log|cancel|retry|cancel-many|retry-many`, and how a job is printed."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer

from app import client

jobs = typer.Typer(help="List, show, cancel and retry jobs.", no_args_is_help=True)

# What a job's answer holds, as the commands read it.
JOB_KEYS = ("id", "state", "model", "attempt", "max_attempts", "priority", "created_at", "progress", "files")


def show(job: dict[str, Any], as_json: bool) -> None:
    """Print a job: JSON, or one readable line."""
    if as_json:
        typer.echo(json.dumps(job, indent=2))
        return
    progress = f" {job['progress'] * 100:.0f}%" if job["state"] == "running" else ""
    error = f"  {job['error'].splitlines()[0]}" if job.get("error") else ""
    typer.echo(
        f"{job['id']}  {job['state']}{progress}  {job['model']}  attempt {job['attempt']}/"
        f"{job['max_attempts']}  priority {job['priority']}  created {job['created_at']}{error}"
    )


@jobs.command("list")
def list_jobs(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state")] = None,
    model: Annotated[str | None, typer.Option(help="Only jobs of this model")] = None,
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many")] = 50,
    cursor: Annotated[str | None, typer.Option(help="Where the page before ended (it prints it)")] = None,
    url: client.Url = client.DEFAULT_URL,
    key: client.Key = None,
    as_json: client.AsJson = False,
) -> None:
    """List jobs, newest first; a page that is not the last says on stderr how to get the next."""
    query = {"state": state, "model": model, "limit": limit, "cursor": cursor}
    with client.connect(url, key) as http:
        page = client.call(
            http, "GET", "/jobs", params={k: v for k, v in query.items() if v is not None}, expect=("jobs",)
        )
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    for job in page["jobs"]:
        show(job, False)
    if page.get("next_cursor"):
        client.stderr().print(f"more: add --cursor {page['next_cursor']}", highlight=False)


@jobs.command("show")
def show_job(
    job_id: str, url: client.Url = client.DEFAULT_URL, key: client.Key = None, as_json: client.AsJson = False
) -> None:
    """One job: state, progress, attempts, error and file links."""
    with client.connect(url, key) as http:
        job = client.call(http, "GET", f"/jobs/{client.job_path(job_id)}", expect=JOB_KEYS)
    show(job, as_json)
    if not as_json:
        for file in job["files"]:
            typer.echo(f"  {file['name']}  {file['bytes']} bytes  {url.rstrip('/')}{file['url']}")


@jobs.command("log")
def job_log(
    job_id: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Go on printing what the model prints until the job ends")
    ] = False,
    url: client.Url = client.DEFAULT_URL,
    key: client.Key = None,
) -> None:
    """Print the log of a job's latest attempt (its model's stdout and stderr)."""
    from app import cli_submit

    with client.connect(url, key) as http:
        job = client.call(http, "GET", f"/jobs/{client.job_path(job_id)}", expect=JOB_KEYS)
        shown = LogReader(http)
        try:
            while True:
                link = _log_link(job)
                if shown.attempt not in (None, job["attempt"]):  # retried: the next attempt's log
                    client.stderr().print(f"--- attempt {job['attempt']} ---", highlight=False)
                shown.read(link, job["attempt"])
                if not follow or job["state"] in cli_submit.FINAL:
                    return
                time.sleep(FOLLOW_EVERY_S)
                job = client.call(http, "GET", f"/jobs/{client.job_path(job_id)}", expect=JOB_KEYS)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


# How often `jobs log --follow` asks for more of the log (and for the job's state).
FOLLOW_EVERY_S = 1.0


def _log_link(job: dict[str, Any]) -> str:
    """The signed link to the latest attempt's log, or exit 2 saying why the job has none."""
    link = job.get("links", {}).get("log")
    if link:
        return str(link)
    if job.get("expired_at"):
        client.fail(f"job {job['id']} has no log: retention deleted its files on {job['expired_at'][:10]}")
    client.fail(f"job {job['id']} has no log yet: it has not run ({job['state']})")


class LogReader:
    """Writes a log to stdout as it grows: each read asks for the bytes past those written."""

    def __init__(self, http: Any) -> None:
        self._http = http
        self.attempt: int | None = None
        self._offset = 0

    def read(self, link: str, attempt: int) -> None:
        """Write what the log at `link` holds past what was written of it (a new attempt's from its start)."""
        if attempt != self.attempt:
            self.attempt, self._offset = attempt, 0
        headers = {"Range": f"bytes={self._offset}-"} if self._offset else {}
        answer = client.request(self._http, "GET", link, headers=headers)
        if answer.status_code == 416:  # nothing past what was written
            return
        if answer.status_code not in (200, 206):
            client.answer(answer)  # exits 2 with the API's reason (410: retention deleted it)
        body = answer.content
        if answer.status_code == 200:  # the whole log (no Range sent, or a log that holds nothing)
            body = body[self._offset :]
        sys.stdout.buffer.write(body)
        sys.stdout.buffer.flush()
        self._offset += len(body)


@jobs.command("cancel")
def cancel_job(job_id: str, url: client.Url = client.DEFAULT_URL, key: client.Key = None) -> None:
    """Cancel a job (queued: at once; running: within a heartbeat)."""
    with client.connect(url, key) as http:
        answer = client.call(http, "POST", f"/jobs/{client.job_path(job_id)}/cancel", expect=("id", "state"))
    typer.echo(f"{answer['id']}  {answer['state']}")


@jobs.command("retry")
def retry_job(
    job_id: str, url: client.Url = client.DEFAULT_URL, key: client.Key = None, as_json: client.AsJson = False
) -> None:
    """Queue a failed, canceled or quarantined job again (admin key)."""
    with client.connect(url, key) as http:
        show(
            client.call(http, "POST", f"/admin/jobs/{client.job_path(job_id)}/retry", expect=JOB_KEYS),
            as_json,
        )


@jobs.command("cancel-many")
def cancel_many(
    model: Annotated[
        str | None, typer.Option(help="Jobs of this model (also one gone from the registry)")
    ] = None,
    owner: Annotated[str | None, typer.Option(help="Jobs submitted with keys of this principal")] = None,
    state: Annotated[
        list[str] | None, typer.Option(help="queued, scheduled or running (repeat it); default: the waiting")
    ] = None,
    every: Annotated[
        bool, typer.Option("--all", help="Every job in those states, with no other filter")
    ] = False,
    url: client.Url = client.DEFAULT_URL,
    key: client.Key = None,
    as_json: client.AsJson = False,
) -> None:
    """Cancel every job matching the filter (admin key); running ones are asked to stop."""
    if model is None and owner is None and not every:
        client.fail("say which jobs: --model, --owner, or --all for every job in the states asked")
    body: dict[str, Any] = {"model": model, "owner": owner, "all": every}
    if state:
        body["states"] = state
    with client.connect(url, key) as http:
        count = client.call(http, "POST", "/admin/jobs/cancel", json=body, expect=("canceled", "stopping"))
    if as_json:
        typer.echo(json.dumps(count))
        return
    typer.echo(canceled_line(count))


def canceled_line(count: dict[str, Any]) -> str:
    """What `cancel-many` prints of the answer: what it did, and what it left (held by others)."""
    line = f"canceled {count['canceled']} jobs; {count['stopping']} running jobs asked to stop"
    if count.get("left"):
        line += f"; {count['left']} left (held by other statements): run the same command again"
    return line


@jobs.command("retry-many")
def retry_many(
    model: Annotated[str | None, typer.Option(help="Failed jobs of this model")] = None,
    error_contains: Annotated[str | None, typer.Option(help="Whose error holds this text")] = None,
    since: Annotated[str | None, typer.Option(help="Finished at or after (ISO 8601)")] = None,
    until: Annotated[str | None, typer.Option(help="Finished before (ISO 8601)")] = None,
    url: client.Url = client.DEFAULT_URL,
    key: client.Key = None,
    as_json: client.AsJson = False,
) -> None:
    """Queue every failed or quarantined job matching the filter again, up to the queue limit (admin key)."""
    body = {"model": model, "error_contains": error_contains, "since": since, "until": until}
    with client.connect(url, key) as http:
        count = client.call(
            http, "POST", "/admin/jobs/retry", json=body, expect=("retried", "left", "queue_full")
        )
    typer.echo(json.dumps(count) if as_json else retried_line(count))


def retried_line(count: dict[str, Any]) -> str:
    """What a bulk retry did, and what is left for the operator to do."""
    line = _left_line(f"retried {count['retried']} jobs", count)
    unserved = count.get("unserved", 0)  # an API of before it counted them says nothing
    if unserved:
        registry = "their model is not in the API's model registry; add it back to retry them"
        return f"{line}; {unserved} not retried: {registry}"
    return line if count["left"] else f"{line}; none left"


def _left_line(done: str, count: dict[str, Any]) -> str:
    """`done`, and the jobs left to a later run of the same retry (`left`), with why."""
    if not count["left"]:
        return done
    if count["queue_full"]:
        full = "the queue is full (GPUJOBS_QUEUE_LIMIT); run this again once it has room"
        return f"{done}; {count['left']} left: {full}"
    return f"{done}; {count['left']} left, held by other requests; run this again"
