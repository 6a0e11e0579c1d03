"""The HTTP client side of the `gpujobs` command: submit, jobs list|show|cancel|retry, prune.

It talks to a running API (`--url` or GPUJOBS_URL) with an API key (`--key` or GPUJOBS_API_KEY).
`submit --wait` follows the job's event stream (GET /jobs/{id}/stream) with a progress bar, resuming
with Last-Event-ID when the connection drops (and after Retry-After when the stream answers 429 or
a 5xx of an API or database away for a moment), then downloads the results. Exit codes: 0 done,
1 the job failed or was canceled, 2 the request was refused, the server could not be reached, or
what answered is not the API.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from app import errors

if TYPE_CHECKING:
    import httpx
    from rich.console import Console

# httpx and rich are imported by the commands that use them, not with this module: every
# `gpujobs` process loads it (a worker too), and the two cost a worker about 0.15 s of CPU to start.
jobs = typer.Typer(help="List, show, cancel and retry jobs.", no_args_is_help=True)

DEFAULT_URL = "http://127.0.0.1:8000"
FINAL = frozenset({"succeeded", "failed", "canceled", "quarantined"})
RECONNECTS = 20
# Answers to a GET that mean "not now" (the database away, the API restarting behind a load
# balancer, too many requests): a stream is asked again, after Retry-After when the answer has one.
TRY_AGAIN = frozenset({429, 502, 503, 504})
RETRY_AFTER_MAX_S = 30.0

Url = Annotated[str, typer.Option("--url", envvar="GPUJOBS_URL", help="The API's base URL")]
Key = Annotated[
    str | None, typer.Option("--key", envvar="GPUJOBS_API_KEY", help="API key (Bearer)", show_default=False)
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON")]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}


def register(cli: typer.Typer) -> None:
    """Add the client commands to the `gpujobs` command."""
    cli.command()(submit)
    cli.add_typer(jobs, name="jobs")
    cli.command()(prune)


@functools.cache
def stderr() -> Console:
    """Where messages for people go: each on one line (soft_wrap), so that stderr read by a script
    or a log (no terminal: rich assumes 80 columns) never has a URL or a reason broken over lines;
    and as they are (no markup: `[/x]` in a model name or a job's error is text, not a tag)."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, markup=False)


def connect(url: str, key: str | None) -> httpx.Client:
    """An HTTP client for the API, sending the key."""
    import httpx

    if key is not None and not key.isascii():
        fail("the API key (--key, GPUJOBS_API_KEY) has characters that are not ASCII; copy it again")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = httpx.Timeout(30.0, read=60.0)  # streams send a keepalive every 15 s
    try:
        return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
    except httpx.InvalidURL as exc:
        fail(f"the API's URL (--url, GPUJOBS_URL) {url!r} is not a URL: {exc}")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print an error and exit."""
    from rich.text import Text

    stderr().print(Text.assemble(("error:", "red"), " ", message), highlight=False)
    raise typer.Exit(code)


# What a job's answer holds, as the commands read it.
JOB_KEYS = ("id", "state", "model", "attempt", "max_attempts", "priority", "created_at", "progress", "files")


def call(http: httpx.Client, method: str, path: str, *, expect: tuple[str, ...] = (), **kwargs: Any) -> Any:
    """One API call; its JSON answer (an object with the keys `expect` names), or exit 2 with the
    server's `detail`, or with "not the API" for an answer the API does not give."""
    import httpx

    try:
        response = http.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        fail(f"cannot reach {http.base_url}: {exc}")
    except httpx.InvalidURL as exc:  # a URL that parsed, but has no usable port, say
        fail(f"the API's URL (--url, GPUJOBS_URL) {str(http.base_url)!r} is not usable: {exc}")
    answer = None
    with contextlib.suppress(ValueError):
        if response.headers.get("content-type", "").startswith("application/json") or response.is_success:
            answer = response.json()
    if response.status_code >= 400 and isinstance(answer, dict) and "detail" in answer:
        fail(f"{response.status_code}: {detail_of(response)}")
    if response.is_success and isinstance(answer, dict) and all(k in answer for k in expect):
        return answer
    not_the_api(response)


def not_the_api(response: httpx.Response) -> NoReturn:
    """Exit 2 for an answer that is not the API's (another server's page, another shape of JSON)."""
    kind = response.headers.get("content-type", "no content type")
    fail(
        f"{response.request.url} answered {response.status_code} ({kind}): not the API; "
        "is --url (GPUJOBS_URL) the API's address?"
    )


def job_path(job_id: str) -> str:
    """The job's id as it goes into a URL (canonical); exit 2 unless it is a UUID, so that no other
    text (`../models`, `../admin/prune#`, "") makes the request for another route."""
    try:
        return str(uuid.UUID(job_id))
    except ValueError:
        fail(f"{job_id!r} is not a job id (a UUID, as `gpujobs jobs list` shows)")


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """`k=v` pairs; values that read as JSON (numbers, true/false) are taken as such, else text."""
    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.strip():
            fail(f"--param {pair!r}: write it as name=value")
        try:
            params[name.strip()] = json.loads(raw)
        except ValueError:
            params[name.strip()] = raw
    return params


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


# -- submit -------------------------------------------------------------------------------------


def submit(
    image: Annotated[Path, typer.Argument(help="PNG, JPEG or WebP image", exists=True, dir_okay=False)],
    model: Annotated[str, typer.Option("--model", "-m", help="A registered model (gpujobs models)")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="Model parameter name=value")
    ] = None,
    priority: Annotated[int, typer.Option(help="Higher runs first")] = 0,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job until it ends")] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", file_okay=False, help="Download the results here (implies --wait)"),
    ] = None,
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: AsJson = False,
) -> None:
    """Upload an image and queue a job; with --wait, show its progress and download the results."""
    with connect(url, key) as http, image.open("rb") as f:
        job = call(
            http,
            "POST",
            "/jobs",
            files={"image": (image.name, f, "application/octet-stream")},
            data={"model": model, "priority": str(priority), "params": json.dumps(parse_params(param or []))},
            expect=JOB_KEYS,
        )
        warn_if_unserved(http, model)
        if not (wait or out):
            show(job, as_json)
            return
        stderr().print(f"job {job['id']} queued", highlight=False)
        follow(http, job["id"])
        job = call(http, "GET", f"/jobs/{job['id']}", expect=JOB_KEYS)
        finish(http, job, out, as_json)


def warn_if_unserved(http: httpx.Client, model: str) -> None:
    """Say so when no live worker serves `model`: its job waits until one starts. Nothing is said
    when the catalog cannot be read or does not count workers (an older server)."""
    import httpx

    try:
        response = http.get("/models")
        entry = next(m for m in response.json()["models"] if m.get("name") == model)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, StopIteration):
        return
    if entry.get("live_workers") == 0:
        stderr().print(
            f"warning: no live worker serves the model {model} now; the job waits until one starts",
            highlight=False,
        )


def finish(http: httpx.Client, job: dict[str, Any], out: Path | None, as_json: bool) -> None:
    """Download the results of a succeeded job; exit 1 with its error otherwise."""
    if job["state"] != "succeeded":
        show(job, as_json)
        fail(f"job {job['id']} {job['state']}: {job.get('error') or 'no error recorded'}", code=1)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"cannot make the folder {out} for the results of job {job['id']}: {exc}")
        for file in job["files"]:
            path = download(http, file["url"], out / Path(file["name"]).name)
            stderr().print(f"wrote {path} ({file['bytes']} bytes)", highlight=False)
    show(job, as_json)


def download(http: httpx.Client, link: str, path: Path) -> Path:
    """Save a signed link to `path` (written to a temporary name, then renamed)."""
    import httpx

    partial = path.with_name(f".{path.name}.partial")
    try:
        with http.stream("GET", link) as response:
            if response.status_code != 200:
                fail(f"download of {path.name} answered {response.status_code}{refusal(response)}")
            with partial.open("wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
        os.replace(partial, path)
    except httpx.HTTPError as exc:
        fail(f"download of {path.name} failed: {exc}")
    except OSError as exc:  # the folder is not writable, the disk is full
        fail(f"cannot write {path}: {exc}")
    finally:
        partial.unlink(missing_ok=True)
    return path


# -- following a job ----------------------------------------------------------------------------


def sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str, Any]]:
    """Server-sent events from a stream's lines: (id, event, data read as JSON, else None)."""
    event_id, event, data = None, "message", ""
    for line in lines:
        if line == "":
            if data:
                try:
                    yield event_id, event, json.loads(data)
                except ValueError:
                    yield event_id, event, None
            event_id, event, data = None, "message", ""
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


def follow(http: httpx.Client, job_id: str) -> None:
    """Show the job's state and progress until it ends, reconnecting with Last-Event-ID."""
    import httpx
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    last: str | None = None
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(), console=stderr(), transient=False,
    ) as bar:  # fmt: skip
        task = bar.add_task("queued", total=1.0)
        for attempt in range(RECONNECTS):
            headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last} if last else {})}
            pause_s = min(0.5 * 2**attempt, 10)
            try:
                with http.stream("GET", f"/jobs/{job_path(job_id)}/stream", headers=headers) as response:
                    if response.status_code in TRY_AGAIN:
                        response.read()
                        pause_s = retry_after_s(response, pause_s)
                        stderr().print(
                            f"stream answered {response.status_code} ({detail_of(response)}); "
                            f"retrying in {pause_s:g} s",
                            highlight=False,
                        )
                        time.sleep(pause_s)
                        continue
                    if response.status_code == 204:  # ended; Last-Event-ID was its last event
                        return
                    if response.status_code != 200:
                        reason = refusal(response)
                        if not reason:
                            not_the_api(response)
                        fail(f"{response.status_code}{reason}")
                    for event_id, _, data in sse(response.iter_lines()):
                        if not isinstance(data, dict) or not {"state", "attempt"} <= data.keys():
                            not_the_api(response)
                        last = event_id or last
                        label = (
                            f"{data['state']} (attempt {data['attempt']})"
                            if data["attempt"]
                            else data["state"]
                        )
                        bar.update(task, description=label, completed=data.get("progress", 0.0))
                        if data["state"] in FINAL:
                            return
            except httpx.HTTPError as exc:
                stderr().print(f"stream interrupted ({exc}); reconnecting", highlight=False)
            time.sleep(pause_s)
    fail(f"lost the stream of job {job_id} {RECONNECTS} times")


def retry_after_s(response: httpx.Response, default_s: float) -> float:
    """The answer's Retry-After in seconds (bounded), or `default_s` without a usable one."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return default_s
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S) if seconds == seconds else default_s


def refusal(response: httpx.Response) -> str:
    """The server's detail, after ": ", of a streamed answer in the API's JSON; "" for any other
    (a proxy's page, a body not worth reading)."""
    if not response.headers.get("content-type", "").startswith("application/json"):
        return ""
    response.read()
    return f": {detail_of(response)}"


def detail_of(response: httpx.Response) -> str:
    """The server's `detail` message, or the body's text."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list) and detail and all(isinstance(e, dict) and "msg" in e for e in detail):
        return "; ".join(_validation_error(e) for e in detail)
    return str(detail)


def _validation_error(error: dict[str, Any]) -> str:
    """One of FastAPI's validation errors as `field: message` (without where the field was sent)."""
    loc = [str(part) for part in error.get("loc", [])]
    if loc and loc[0] in {"path", "query", "body", "header", "cookie"}:
        loc = loc[1:]
    return f"{'.'.join(loc)}: {error['msg']}" if loc else str(error["msg"])


# -- jobs ---------------------------------------------------------------------------------------


@jobs.command("list")
def list_jobs(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state")] = None,
    model: Annotated[str | None, typer.Option(help="Only jobs of this model")] = None,
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many")] = 50,
    cursor: Annotated[str | None, typer.Option(help="Where the page before ended (it prints it)")] = None,
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: AsJson = False,
) -> None:
    """List jobs, newest first; a page that is not the last says on stderr how to get the next."""
    query = {"state": state, "model": model, "limit": limit, "cursor": cursor}
    with connect(url, key) as http:
        page = call(
            http, "GET", "/jobs", params={k: v for k, v in query.items() if v is not None}, expect=("jobs",)
        )
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    for job in page["jobs"]:
        show(job, False)
    if page.get("next_cursor"):
        stderr().print(f"more: add --cursor {page['next_cursor']}", highlight=False)


@jobs.command("show")
def show_job(job_id: str, url: Url = DEFAULT_URL, key: Key = None, as_json: AsJson = False) -> None:
    """One job: state, progress, attempts, error and file links."""
    with connect(url, key) as http:
        job = call(http, "GET", f"/jobs/{job_path(job_id)}", expect=JOB_KEYS)
    show(job, as_json)
    if not as_json:
        for file in job["files"]:
            typer.echo(f"  {file['name']}  {file['bytes']} bytes  {url.rstrip('/')}{file['url']}")


@jobs.command("cancel")
def cancel_job(job_id: str, url: Url = DEFAULT_URL, key: Key = None) -> None:
    """Cancel a job (queued: at once; running: within a heartbeat)."""
    with connect(url, key) as http:
        answer = call(http, "POST", f"/jobs/{job_path(job_id)}/cancel", expect=("id", "state"))
    typer.echo(f"{answer['id']}  {answer['state']}")


@jobs.command("retry")
def retry_job(job_id: str, url: Url = DEFAULT_URL, key: Key = None, as_json: AsJson = False) -> None:
    """Queue a failed, canceled or quarantined job again (admin key)."""
    with connect(url, key) as http:
        show(call(http, "POST", f"/admin/jobs/{job_path(job_id)}/retry", expect=JOB_KEYS), as_json)


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
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: AsJson = False,
) -> None:
    """Cancel every job matching the filter (admin key); running ones are asked to stop."""
    if model is None and owner is None and not every:
        fail("say which jobs: --model, --owner, or --all for every job in the states asked")
    body: dict[str, Any] = {"model": model, "owner": owner, "all": every}
    if state:
        body["states"] = state
    with connect(url, key) as http:
        count = call(http, "POST", "/admin/jobs/cancel", json=body, expect=("canceled", "stopping"))
    if as_json:
        typer.echo(json.dumps(count))
        return
    typer.echo(f"canceled {count['canceled']} jobs; {count['stopping']} running jobs asked to stop")


@jobs.command("retry-many")
def retry_many(
    model: Annotated[str | None, typer.Option(help="Failed jobs of this model")] = None,
    error_contains: Annotated[str | None, typer.Option(help="Whose error holds this text")] = None,
    since: Annotated[str | None, typer.Option(help="Finished at or after (ISO 8601)")] = None,
    until: Annotated[str | None, typer.Option(help="Finished before (ISO 8601)")] = None,
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: AsJson = False,
) -> None:
    """Queue every failed or quarantined job matching the filter again, up to the queue limit (admin key)."""
    body = {"model": model, "error_contains": error_contains, "since": since, "until": until}
    with connect(url, key) as http:
        count = call(http, "POST", "/admin/jobs/retry", json=body, expect=("retried", "left", "queue_full"))
    typer.echo(json.dumps(count) if as_json else retried_line(count))


def retried_line(count: dict[str, Any]) -> str:
    """What a bulk retry did, and what is left for the operator to do."""
    done = f"retried {count['retried']} jobs"
    if not count["left"]:
        return f"{done}; none left"
    if count["queue_full"]:
        full = "the queue is full (GPUJOBS_QUEUE_LIMIT); run this again once it has room"
        return f"{done}; {count['left']} left: {full}"
    return f"{done}; {count['left']} left, held by other requests; run this again"


# -- prune --------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds in "90", "30s", "15m", "12h", "7d" or "2w"."""
    match = _DURATION.match(text.lower())
    if match is None:
        raise errors.InvalidRequest(f"{text!r} is not a duration (examples: 90s, 15m, 12h, 7d, 2w)")
    seconds = float(match[1]) * _UNIT_S[match[2]]
    if not math.isfinite(seconds):  # JSON has no infinity; a finite one too long gets the server's 422
        raise errors.InvalidRequest(f"{text!r} is longer than any duration (examples: 90s, 12h, 7d, 2w)")
    return seconds


def prune(
    older_than: Annotated[
        str | None,
        typer.Option(help="Finished longer ago than this (90s, 12h, 7d, 2w); default: the server's"),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would be deleted")] = False,
    url: Url = DEFAULT_URL,
    key: Key = None,
    as_json: AsJson = False,
) -> None:
    """Delete the files, logs and unused inputs of old finished jobs now (admin key)."""
    try:
        seconds = None if older_than is None else parse_duration(older_than)
    except errors.InvalidRequest as exc:
        fail(exc.message)
    with connect(url, key) as http:
        body = {"older_than_s": seconds, "dry_run": dry_run}
        expect = ("jobs", "cutoff", "files_bytes", "inputs_bytes", "inputs_deleted")
        report = call(http, "POST", "/admin/prune", json=body, expect=expect)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    verb = "would expire" if dry_run else "expired"
    if report["inputs_deleted"] is None:  # a dry run: an image may also be used by a job that stays
        inputs = " of files (inputs not counted)"
    else:
        inputs = f", {report['inputs_deleted']} inputs deleted"
    freed = report["files_bytes"] + report["inputs_bytes"]
    typer.echo(f"{verb} {report['jobs']} jobs finished before {report['cutoff']}: {freed} bytes{inputs}")
