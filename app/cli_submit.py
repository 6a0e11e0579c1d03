"""`gpujobs submit`: upload an image and queue a job; with --wait, follow it and download its results.

`submit --wait` follows the job's event stream (GET /jobs/{id}/stream) with a progress bar, resuming
with Last-Event-ID when the connection drops (and after Retry-After when the stream answers 429 or
a 5xx of an API or database away for a moment), then downloads the results into a folder of
`--out` named for the image, never over files already there unless `--force` (`results_folder`).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer

from app import cli_jobs, client, sigterm

if TYPE_CHECKING:
    import httpx

# httpx and rich are imported by the functions that use them, as in app/client.py: every `gpujobs`
# process loads this module (a worker too).

# submit's --out and --force (results_folder)
Out = Annotated[
    Path | None,
    typer.Option(
        "--out",
        file_okay=False,
        help="Download the results into OUT/<image name without extension>/ (implies --wait)",
    ),
]
Force = Annotated[bool, typer.Option("--force", help="Replace results already in that folder (else: exit 2)")]


FINAL = frozenset({"succeeded", "failed", "canceled", "quarantined"})
RECONNECTS = 20  # tries in a row of a job's stream that bring no event
# How long, in all, an upload answered 429 (nothing stored: the key's uploads at their cap, the
# queue full) is sent again after the answer's Retry-After before `submit` gives up.
UPLOAD_PATIENCE_S = 120.0
# Answers to a GET that mean "not now" (the database away, the API restarting behind a load
# balancer): a stream is asked again, after Retry-After when the answer has one, each a failure in
# a row. A 429 (the key's streams at their cap) is waited on apart: it counts no failure.
TRY_AGAIN = frozenset({502, 503, 504})
RETRY_AFTER_MAX_S = 30.0


def parse_params(pairs: list[str], types: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`k=v` pairs, typed (see `typed`). A malformed pair, or a name given twice, exits 2."""
    return typed_params(split_params(pairs), types or {})


def typed_params(given: Mapping[str, str], types: Mapping[str, str]) -> dict[str, Any]:
    """`split_params`' values, each typed by its param's type in `types` (see `typed`)."""
    return {name: typed(raw, types.get(name)) for name, raw in given.items()}


def split_params(pairs: list[str]) -> dict[str, str]:
    """`k=v` pairs as name -> the text after `=`. A name given twice is refused: which value was
    meant is not ours to guess."""
    params: dict[str, str] = {}
    names = Counter(pair.partition("=")[0].strip() for pair in pairs)
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            client.fail(f"--param {pair!r}: write it as name=value")
        if names[name] > 1:
            client.fail(f"--param {name!r} is given {names[name]} times; give it once")
        params[name] = raw
    return params


def typed(raw: str, kind: str | None) -> Any:
    """A value that reads as JSON (numbers, true/false) is taken as such, else as text; for a param
    of type `str` (the model's schema, from GET /models) text it stays, unless quoted as a JSON
    string: `-p output=true` sends "true", as the server wants it."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return raw if kind == "str" and not isinstance(value, str) else value


def submit(
    image: Annotated[Path, typer.Argument(help="PNG, JPEG or WebP image", exists=True, dir_okay=False)],
    model: Annotated[str, typer.Option("--model", "-m", help="A registered model (gpujobs models)")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="Model parameter name=value")
    ] = None,
    priority: Annotated[int, typer.Option(help="Higher runs first")] = 0,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job until it ends")] = False,
    out: Out = None,
    force: Force = False,
    url: client.Url = client.DEFAULT_URL,
    key: client.Key = None,
    as_json: client.AsJson = False,
) -> None:
    """Upload an image and queue a job; with --wait, show its progress and download the results."""
    given = split_params(param or [])  # a malformed --param is refused before any request
    folder = results_folder(out, image, force)
    if not image.is_file():  # a FIFO, a device: its open or read would wait for ever
        client.fail(f"{image} is not a regular file: give an image file")
    # SIGTERM (kill, systemd, a CI job's timeout) ends it through Python: a download's partial file goes.
    with sigterm.exit_on_sigterm(), client.connect(url, key) as http, image.open("rb") as f:
        entry = catalog_entry(http, model)
        params = typed_params(given, param_types(entry))
        job = upload(
            http, image, f, data={"model": model, "priority": str(priority), "params": json.dumps(params)}
        )
        warn_if_unserved(entry, model)
        if not (wait or out):
            cli_jobs.show(job, as_json)
            return
        client.stderr().print(f"job {job['id']} queued", highlight=False)
        follow(http, job["id"])
        job = client.call(http, "GET", f"/jobs/{job['id']}", expect=cli_jobs.JOB_KEYS)
        finish(http, job, folder, as_json, replace=force)


def upload(http: httpx.Client, image: Path, f: BinaryIO, data: dict[str, str]) -> dict[str, Any]:
    """POST /jobs with the image `f` (opened from `image`) and the form `data`: the job, or exit 2
    with the server's refusal or the image's read error."""
    waited_s = 0.0
    try:
        while True:
            f.seek(0)  # a try refused before its body was read may have sent part of it
            files = {"image": (image.name, f, "application/octet-stream")}
            response = client.request(http, "POST", "/jobs", files=files, data=data)
            pause_s = retry_after_s(response, 5.0) if response.status_code == 429 else None
            if pause_s is None or waited_s + pause_s > UPLOAD_PATIENCE_S:
                break
            # Nothing was stored: the key's uploads at their cap, or the queue full for now.
            client.stderr().print(
                f"upload answered 429 ({client.detail_of(response)}); sending it again in {pause_s:g} s",
                highlight=False,
            )
            time.sleep(pause_s)
            waited_s += pause_s
        job: dict[str, Any] = client.answer(response, expect=cli_jobs.JOB_KEYS)
    except OSError as exc:  # reading the image (the network's errors are httpx's)
        client.fail(f"cannot read {image}: {exc}")
    return job


def catalog_entry(http: httpx.Client, model: str) -> dict[str, Any] | None:
    """`model`'s entry in GET /models; None where the catalog cannot be read or lacks it."""
    import httpx

    try:
        response = http.get("/models")
        entry = next(m for m in response.json()["models"] if m.get("name") == model)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return None
    return entry if isinstance(entry, dict) else None


def param_types(entry: dict[str, Any] | None) -> dict[str, str]:
    """Each param's type in a catalog entry (`str`, `int`...); none known without one."""
    params = entry.get("params") if entry is not None else None
    if not isinstance(params, dict):
        return {}
    return {
        name: spec["type"]
        for name, spec in params.items()
        if isinstance(spec, dict) and isinstance(spec.get("type"), str)
    }


def warn_if_unserved(entry: dict[str, Any] | None, model: str) -> None:
    """Say so when no live worker serves `model` (its catalog entry): its job waits until one
    starts. Nothing is said without an entry, or one that does not count workers (an older server)."""
    if entry is not None and entry.get("live_workers") == 0:
        client.stderr().print(
            f"warning: no live worker serves the model {model} now; the job waits until one starts",
            highlight=False,
        )


def results_folder(out: Path | None, image: Path, force: bool) -> Path | None:
    """Where `--out` puts this image's results: OUT/<image name without extension>/, so that a loop
    over a folder of photos keeps each one's (every relief result is named mesh.<format>: in OUT
    itself the next job's replaced the last one's). Exit 2 before anything is uploaded when that
    folder already holds files (an earlier job's, or another image of the same name's), unless
    `force`."""
    if out is None:
        return None
    # An image named "..png" or "...png" has the stem "." or "..": OUT itself, or its parent.
    folder = out / (image.stem if image.stem.strip(".") else image.name)
    if folder.exists() and not folder.is_dir():
        client.fail(f"{folder} is a file: the results of {image.name} go into a folder of that name")
    there_now = next(p for p in (folder, *folder.parents) if p.exists())  # `.` or `/` at the least
    if not there_now.is_dir() or not os.access(there_now, os.W_OK | os.X_OK):
        why = "is a file" if not there_now.is_dir() else "is not writable"
        client.fail(f"cannot make the folder {folder} for the results: {there_now} {why}")
    try:
        there = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    except OSError as exc:
        client.fail(f"cannot read the folder {folder} for the results: {exc}")
    if there and not force:
        shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        client.fail(
            f"{folder} already holds {shown} (the results of an earlier job?): "
            "use another --out, or --force to replace them"
        )
    return folder


def finish(
    http: httpx.Client, job: dict[str, Any], out: Path | None, as_json: bool, *, replace: bool = False
) -> None:
    """Download the results of a succeeded job into `out` (replacing files there only if
    `replace`); exit 1 with its error if it did not succeed."""
    if job["state"] != "succeeded":
        cli_jobs.show(job, as_json)
        client.fail(f"job {job['id']} {job['state']}: {job.get('error') or 'no error recorded'}", code=1)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            client.fail(f"cannot make the folder {out} for the results of job {job['id']}: {exc}")
        for file in job["files"]:
            path = download(http, file["url"], out / Path(file["name"]).name, replace=replace)
            client.stderr().print(f"wrote {path} ({file['bytes']} bytes)", highlight=False)
    cli_jobs.show(job, as_json)


def download(http: httpx.Client, link: str, path: Path, *, replace: bool = False) -> Path:
    """Save a signed link to `path`: written to a temporary name, then put in place whole; an
    existing file there is replaced only if `replace` (else exit 2, naming it)."""
    import httpx

    partial: Path | None = None
    try:
        partial = _partial(path)
        with partial.open("wb") as f, http.stream("GET", link) as response:
            if response.status_code != 200:
                client.fail(
                    f"download of {path.name} answered {response.status_code}{client.refusal(response)}"
                )
            for chunk in response.iter_bytes():
                f.write(chunk)
        _put_in_place(partial, path, replace=replace)
    except FileExistsError:
        client.fail(f"{path} exists (written meanwhile by another job?): kept; use --force to replace it")
    except httpx.HTTPError as exc:
        client.fail(f"download of {path.name} failed: {exc}")
    except OSError as exc:  # the folder is not writable, the disk is full
        client.fail(f"cannot write {path}: {exc}")
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)
    return path


def _partial(path: Path) -> Path:
    """A new, empty file beside `path`, named for it and for no one else: two submits writing the
    same file name into one folder at once (images of one name from two folders) each wrote into
    the other's partial file. With the mode a plain `open` gives (mkstemp's is 0600)."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    os.close(fd)
    return Path(name)


def _put_in_place(partial: Path, path: Path, *, replace: bool) -> None:
    """Give the written file its name at once; without `replace`, raise FileExistsError rather than
    replace a file of that name (a hard link is made only if the name is free: no race with another
    `submit` writing into the folder at the same moment)."""
    if replace:
        os.replace(partial, path)
        return
    try:
        os.link(partial, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # FileExistsError among them
        # no hard links on this file system (FAT, some network shares)
        if path.exists():
            raise FileExistsError(path) from None
        os.replace(partial, path)


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
        TimeElapsedColumn(), console=client.stderr(), transient=False,
    ) as bar:  # fmt: skip
        task = bar.add_task("queued", total=1.0)
        # Tries in a row that brought no event: a stream that delivered one starts the count again
        # (an API restarted twenty times over a long job is no reason to give up on it).
        failures = 0
        while failures < RECONNECTS:
            headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last} if last else {})}
            pause_s = min(0.5 * 2**failures, 10)
            try:
                path = f"/jobs/{client.job_path(job_id)}/stream"
                with http.stream("GET", path, headers=headers) as response:
                    if response.status_code == 429:  # the key's streams at their cap: one will end
                        time.sleep(_pause_asked(response, pause_s))
                        continue
                    if response.status_code in TRY_AGAIN:
                        failures += 1
                        time.sleep(_pause_asked(response, pause_s))
                        continue
                    if _ended(response):
                        return
                    for event_id, data in _states(response):
                        failures = 0
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
                client.stderr().print(f"stream interrupted ({exc}); reconnecting", highlight=False)
            failures += 1
            time.sleep(min(0.5 * 2 ** (failures - 1), 10))
    client.fail(f"lost the stream of job {job_id} {RECONNECTS} times in a row")


def _pause_asked(response: httpx.Response, default_s: float) -> float:
    """How long to wait before asking a stream that answered "not now" again (said on stderr)."""
    response.read()
    pause_s = retry_after_s(response, default_s)
    client.stderr().print(
        f"stream answered {response.status_code} ({client.detail_of(response)}); retrying in {pause_s:g} s",
        highlight=False,
    )
    return pause_s


def _ended(response: httpx.Response) -> bool:
    """Whether the stream answered that the job has ended (204: Last-Event-ID was its last event);
    exit 2 for any answer but that and 200."""
    if response.status_code == 204:
        return True
    if response.status_code != 200:
        reason = client.refusal(response)
        if not reason:
            client.not_the_api(response)
        client.fail(f"{response.status_code}{reason}")
    return False


def _states(response: httpx.Response) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """The stream's events as (id, the job's state); exit 2 at one that is not the API's."""
    for event_id, _, data in sse(response.iter_lines()):
        if not isinstance(data, dict) or not {"state", "attempt"} <= data.keys():
            client.not_the_api(response)
        yield event_id, data


def retry_after_s(response: httpx.Response, default_s: float) -> float:
    """The answer's Retry-After in seconds (bounded), or `default_s` without a usable one."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return default_s
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S) if seconds == seconds else default_s
