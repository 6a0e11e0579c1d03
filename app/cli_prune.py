"""`gpujobs prune`: delete the files, logs and unused inputs of old finished jobs now (admin key)."""

from __future__ import annotations

import json
import math
import re
from typing import Annotated

import typer

from app import client, errors

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}


def parse_duration(text: str) -> float:
    """Seconds in "30s", "15m", "12h", "7d" or "2w". A number without its unit is refused: read as
    seconds, `--older-than 30` (meant as GPUJOBS_RETENTION_DAYS is written, in days) deleted the
    results of every job that finished more than 30 seconds before."""
    match = _DURATION.match(text.lower())
    if match is None:
        raise errors.InvalidRequest(f"{text!r} is not a duration (examples: 90s, 15m, 12h, 7d, 2w)")
    if not match[2]:
        number = match[1]
        raise errors.InvalidRequest(
            f"{text!r} has no unit: write {number}d (days), {number}h (hours), {number}m or {number}s"
        )
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
    url: client.Url = client.DEFAULT_URL,
    key: client.Key = None,
    as_json: client.AsJson = False,
) -> None:
    """Delete the files, logs and unused inputs of old finished jobs now (admin key)."""
    try:
        seconds = None if older_than is None else parse_duration(older_than)
    except errors.InvalidRequest as exc:
        client.fail(exc.message)
    with client.connect(url, key) as http:
        body = {"older_than_s": seconds, "dry_run": dry_run}
        expect = ("jobs", "cutoff", "files_bytes", "inputs_bytes", "inputs_deleted")
        report = client.call(http, "POST", "/admin/prune", json=body, expect=expect)
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
