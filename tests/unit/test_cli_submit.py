"""`gpujobs submit`: following a job's stream for as long as it runs, an upload refused for now,
and the folder `--out` gives each image's results. Against httpx's mock transport: the answers
here are the API's (its real ones are in tests/integration/test_client.py)."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import typer

from app import cli_submit
from tests.conftest import png_bytes

JOB_ID = str(uuid.uuid4())
JOB = {
    "id": JOB_ID, "state": "queued", "model": "toy", "attempt": 0, "max_attempts": 3,
    "priority": 0, "created_at": "2026-11-28T00:00:00Z", "progress": 0.0, "files": [],
}  # fmt: skip
STREAM = {"content-type": "text/event-stream"}


def event(event_id: int, state: str) -> bytes:
    """One `state` event of a job's stream, as the API sends it."""
    data = {"state": state, "attempt": 1, "progress": 1.0 if state == "succeeded" else 0.5}
    return f"id: {event_id}\nevent: state\ndata: {json.dumps(data)}\n\n".encode()


def follow(
    handler: Callable[[httpx.Request], httpx.Response], monkeypatch: pytest.MonkeyPatch
) -> list[float]:
    """Run `follow` against `handler`; the pauses it took (not slept)."""
    slept: list[float] = []
    monkeypatch.setattr(cli_submit.time, "sleep", slept.append)
    with httpx.Client(base_url="http://api", transport=httpx.MockTransport(handler)) as http:
        cli_submit.follow(http, JOB_ID)
    return slept


def test_a_stream_that_ends_now_and_then_is_followed_to_the_jobs_end(monkeypatch):
    """Every reconnect counted against 20 tries for the job's whole life, events or not: a job
    whose API restarted 20 times while it ran (18 restarts, 14 s apart, in the review) ended
    `submit --wait` with "lost the stream" (exit 2), the job still running, its results never
    fetched. Only tries in a row that bring no event count now, and the pause starts short again."""
    streams = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal streams
        streams += 1
        return httpx.Response(
            200, headers=STREAM, content=event(streams, "succeeded" if streams > 30 else "running")
        )

    slept = follow(handler, monkeypatch)
    assert streams == 31 and set(slept) == {0.5}


def test_a_stream_that_brings_nothing_is_given_up_after_twenty_tries_in_a_row(monkeypatch, capsys):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"retry-after": "1"}, json={"detail": "the database is away"})

    with pytest.raises(typer.Exit):
        follow(handler, monkeypatch)
    assert capsys.readouterr().err.strip().endswith(f"lost the stream of job {JOB_ID} 20 times in a row")


def test_a_stream_refused_for_the_keys_cap_is_waited_on_however_long(monkeypatch):
    """Past GPUJOBS_STREAMS_PER_KEY a stream is 429 with Retry-After: 15 until one of the key's
    streams ends; `submit --wait` waits and asks again (docs/operations.md), but gave up after 20
    such answers (5 minutes) while its job waited in the queue. Those answers do not count now."""
    asked = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal asked
        asked += 1
        if asked <= 40:
            return httpx.Response(
                429, headers={"retry-after": "15"}, json={"detail": "32 event streams open"}
            )
        return httpx.Response(200, headers=STREAM, content=event(9, "succeeded"))

    assert follow(handler, monkeypatch) == [15.0] * 40


def submit(
    image: Path, answers: list[httpx.Response], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, list[float]]:
    """`gpujobs submit image -m toy --json` against `answers` to its uploads, in turn: (uploads
    sent, pauses taken). The bodies sent must each be the whole image."""
    sent: list[bytes] = []
    slept: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/models":
            return httpx.Response(200, json={"models": [{"name": "toy", "params": {}, "live_workers": 1}]})
        sent.append(request.read())
        return answers[len(sent) - 1]

    monkeypatch.setattr(cli_submit.time, "sleep", slept.append)
    monkeypatch.setattr(
        cli_submit.client, "connect",
        lambda url, key: httpx.Client(base_url=url, transport=httpx.MockTransport(handler)),
    )  # fmt: skip
    try:
        cli_submit.submit(image, "toy", param=None, url="http://api", key="k", as_json=True)
    finally:
        assert all(image.read_bytes() in body for body in sent)
    return len(sent), slept


def test_an_upload_refused_for_now_is_sent_again_after_its_retry_after(tmp_path, monkeypatch, capsys):
    """The key's uploads at their cap (GPUJOBS_UPLOADS_PER_KEY) is a 429 with Retry-After: 5,
    answered before the body is read: nothing is stored, and it says to send the image again. Of
    twelve `gpujobs submit` run at once in the review, three exited 2 with it, their images never
    queued. Now it is sent again after the pause asked for, and said so on stderr."""
    image = tmp_path / "photo.png"
    image.write_bytes(png_bytes())
    cap = httpx.Response(429, headers={"retry-after": "5"}, json={"detail": "you have 8 uploads in progress"})
    sent, slept = submit(image, [cap, cap, httpx.Response(201, json=JOB)], monkeypatch)
    assert (sent, slept) == (3, [5.0, 5.0])
    out, err = capsys.readouterr()
    assert json.loads(out)["id"] == JOB_ID
    assert "upload answered 429 (you have 8 uploads in progress); sending it again in 5 s" in err


def test_an_upload_refused_past_the_patience_exits_with_the_refusal(tmp_path, monkeypatch, capsys):
    image = tmp_path / "photo.png"
    image.write_bytes(png_bytes())
    full = httpx.Response(429, headers={"retry-after": "30"}, json={"detail": "the queue is full"})
    with pytest.raises(typer.Exit) as ended:
        submit(image, [full] * 10, monkeypatch)
    assert ended.value.exit_code == 2
    assert capsys.readouterr().err.strip().endswith("error: 429: the queue is full")


@pytest.mark.parametrize(
    ("name", "folder"), [("...png", "...png"), ("..png", "..png"), (".png", ".png"), ("a.png", "a")]
)
def test_the_results_of_an_image_go_into_a_folder_of_their_own_inside_out(
    tmp_path: Path, name: str, folder: str
):
    """OUT/<the image's name without extension>/: the stem of "...png" is "..", of "..png" ".",
    so `submit ...png --out meshes/` wrote its mesh beside meshes/, and `..png` into meshes/
    itself, where the next image's results replaced it."""
    out = tmp_path / "meshes"
    given = cli_submit.results_folder(out, Path(name), force=False)
    assert given == out / folder and Path(os.path.normpath(given)).parent == out
