"""Downloads of files that change while they are sent: a running job's log grows as it is read."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import text

from app import storage
from tests.conftest import api_client
from tests.integration.test_worker import enqueue

# Larger than what the loopback socket's buffers and the server's write buffer hold together, so
# the server is still reading the file when the client has the answer's headers.
BIG_LOG_BYTES = 32 * 1024 * 1024


@pytest.mark.parametrize("ranges", [None, "bytes=0-", "bytes=10-"])
async def test_a_log_that_grows_while_it_is_sent_is_sent_as_long_as_it_was(
    settings, manager, make_worker, ranges
):
    """A running job's log is downloaded while its model prints on. The answer's Content-Length is
    the log's size when the route opened it; the body was read to the file's end, past that
    length, and the server broke off the answer: the download failed half-way (and the server
    logged an error). Now the body is the log as long as it was, and a new download gets the rest."""
    job_id = await enqueue(manager)
    await make_worker().run()
    path = storage.log_file(settings.storage_dir.resolve(), job_id, 1)
    with path.open("ab") as f:
        f.write(b"x" * BIG_LOG_BYTES)
    before = path.read_bytes()
    start = 10 if ranges == "bytes=10-" else 0
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["links"]["log"]
        headers = {"Range": ranges} if ranges else {}
        async with http.stream("GET", url, headers=headers) as answer:
            with path.open("ab") as f:  # the model prints while the log is being sent
                f.write(b"printed later\n" * 10_000)
            body = await answer.aread()
        assert answer.status_code == (200 if ranges is None else 206)
        assert answer.headers["content-length"] == str(len(before) - start)
        assert body == before[start:]
        again = await http.get(url, headers=headers)  # a new download has what was printed since
        assert again.content == path.read_bytes()[start:] and again.content.endswith(b"printed later\n")


async def test_a_range_in_another_unit_or_malformed_is_ignored(settings, manager, make_worker):
    """A Range in a unit the server does not know must be ignored (RFC 9110, 14.2), and a malformed
    one may be: both answered 400 with a line of plain text, not even the API's JSON. Now the whole
    file (200); a range past the end is still 416."""
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["files"][0]["url"]
        whole = (await http.get(url)).content
        for ranges in ("items=0-1", "bytes=3-1", "bytes=abc", "bytes", "bytes=-"):
            answer = await http.get(url, headers={"Range": ranges})
            assert answer.status_code == 200, (ranges, answer.text)
            assert answer.content == whole and "content-range" not in answer.headers
        assert (await http.get(url, headers={"Range": "bytes=1-2"})).content == whole[1:3]
        assert (await http.get(url, headers={"Range": "bytes=999-"})).status_code == 416


async def test_a_log_sent_again_unchanged_is_not_modified(settings, manager, make_worker):
    """A log is sent with an ETag (its size and time), but an If-None-Match naming it was ignored:
    the whole log again (200). Now 304 while the log is unchanged, and 200 once it grew."""
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["links"]["log"]
        first = await http.get(url)
        etag = first.headers["etag"]
        assert first.status_code == 200 and first.content and etag
        same = await http.get(url, headers={"If-None-Match": etag})
        assert same.status_code == 304 and same.content == b"" and same.headers["etag"] == etag
        assert (await http.head(url, headers={"If-None-Match": etag})).status_code == 304
        # One list over two header lines (RFC 9110, 5.3), as proxies split it: only the first was read.
        split = httpx.Headers([("If-None-Match", '"another"'), ("If-None-Match", etag)])
        assert (await http.get(url, headers=split)).status_code == 304
        with storage.log_file(settings.storage_dir.resolve(), job_id, 1).open("ab") as f:
            f.write(b"printed later\n")
        grown = await http.get(url, headers={"If-None-Match": etag})
        assert grown.status_code == 200 and grown.content.endswith(b"printed later\n")


async def test_a_log_is_revalidated_and_a_result_kept_no_longer_than_its_link(settings, manager, make_worker):
    """Every download said `Cache-Control: private, max-age=3600`: a browser kept a log that was
    still growing for an hour, and a result for an hour past the end of a shorter-lived link. Now
    a log is `no-cache` (asked again each time; a 304 while unchanged), and a result is kept for
    at most the link's remaining life."""
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings, link_ttl_s=60) as http:
        job = (await http.get(f"/jobs/{job_id}")).json()
        log = await http.get(job["links"]["log"])
        assert log.status_code == 200 and log.headers["cache-control"] == "no-cache"
        result = await http.get(job["files"][0]["url"])
        policy, max_age = result.headers["cache-control"].split(", max-age=")
        assert result.status_code == 200 and policy == "private" and 0 < int(max_age) <= 60


async def test_an_expired_link_of_a_job_retention_deleted_is_gone(settings, manager, make_worker, engine):
    """An expired link said "fetch the job again for a fresh one" (403), also when retention had
    deleted the job's files: fetched again, the job has no links. Now 410, saying the files were
    deleted; an expired link of a job that still has its files stays 403."""
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings) as http:
        signer = http.app.state.services.signer
        url = signer.url(job_id, "out.txt", now=time.time() - signer.ttl_s - 60)
        stale = await http.get(url)
        assert stale.status_code == 403 and "fetch the job again" in stale.json()["detail"]
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE jobs SET expired_at = now() WHERE id = :id"), {"id": job_id})
        gone = await http.get(url)
        assert gone.status_code == 410 and "deleted by retention" in gone.json()["detail"], gone.text
        assert (await http.get(url.replace("sig=", "sig=x"))).status_code == 403  # not signed: no word


async def test_a_method_links_do_not_answer_is_told_they_answer_get_and_head(settings, manager, make_worker):
    """A POST (or PUT) to a link is 405, whose Allow said only GET, though links answer HEAD too
    (download tools ask it first). Now `Allow: GET, HEAD`; HEAD stays out of the OpenAPI document."""
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["files"][0]["url"]
        for method in ("POST", "PUT", "DELETE"):
            answer = await http.request(method, url)
            assert answer.status_code == 405, (method, answer.text)
            assert answer.headers["allow"] == "GET, HEAD", method
        assert (await http.head(url)).status_code == 200
        paths = http.app.openapi()["paths"]
        assert list(paths["/files/{job_id}/{name}"]) == ["get"]


async def test_ranges_past_the_end_are_dropped_when_others_can_be_sent(settings, manager, make_worker):
    """`Range: bytes=0-1,99999999999-` was 416, though RFC 9110 (14.1.1) answers 416 only when no
    range can be satisfied. Now the ranges past the end are dropped and the others sent; when
    none is left, still 416."""
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["files"][0]["url"]
        whole = (await http.get(url)).content
        one = await http.get(url, headers={"Range": "bytes=0-1,99999999999-"})
        assert one.status_code == 206, one.text
        assert one.content == whole[:2] and one.headers["content-range"] == f"bytes 0-1/{len(whole)}"
        two = await http.get(url, headers={"Range": "bytes=0-1, 999-, 3-4"})
        assert two.status_code == 206 and two.headers["content-type"].startswith("multipart/byteranges")
        assert whole[:2] in two.content and whole[3:5] in two.content
        for ranges in ("bytes=999-", "bytes=999-, 99999999999-"):
            assert (await http.get(url, headers={"Range": ranges})).status_code == 416, ranges
