"""The web page in a real browser: sign in, submit, watch, preview in 3D, download, cancel, retry.

Each test runs the whole service (API and worker in one process, a fresh database) and drives
headless Chromium through it as a person would: see conftest.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tests.browser.conftest import Site, ramp_png, sign_in

expect = pytest.importorskip(
    "playwright.async_api", reason="the playwright package is missing: pip install -e '.[test]'"
).expect

# Share of the canvas the mesh covers, and how many colours its shading has.
PAINTED = """(canvas) => {
  const copy = document.createElement('canvas');
  copy.width = canvas.width;
  copy.height = canvas.height;
  const ctx = copy.getContext('2d');
  ctx.drawImage(canvas, 0, 0);
  const data = ctx.getImageData(0, 0, copy.width, copy.height).data;
  let covered = 0;
  const colours = new Set();
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] > 0) { covered += 1; colours.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]); }
  }
  return { covered: covered / (data.length / 4), colours: colours.size, width: copy.width };
}"""

DROP = """([zone, name, type, b64]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const transfer = new DataTransfer();
  transfer.items.add(new File([bytes], name, { type }));
  zone.dispatchEvent(new DragEvent('drop', { dataTransfer: transfer, bubbles: true, cancelable: true }));
}"""


async def drop(page: Any, name: str, data: bytes, media_type: str = "image/png") -> None:
    """Drop a file on the form's drop zone, as dragging it from the desktop does."""
    zone = await page.locator("#dropzone").element_handle()
    await page.evaluate(DROP, [zone, name, media_type, base64.b64encode(data).decode()])


async def submit_api(site: Site, model: str = "toy", **params: Any) -> str:
    """Submit a job as alice through the API; its id."""
    async with site.client(site.user_key) as alice:
        answer = await alice.post(
            "/jobs",
            files={"image": ("in.png", ramp_png(), "image/png")},
            data={"model": model, "params": json.dumps(params)},
        )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


async def wait_state(http: httpx.AsyncClient, job_id: str, states: set[str], timeout_s: float = 30) -> dict:
    """Poll the API until the job is in one of `states`."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = (await http.get(f"/jobs/{job_id}")).json()
        if job["state"] in states:
            return dict(job)
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.05)


async def test_sign_in_submit_watch_live_preview_in_3d_and_download(make_site, page, tmp_path):
    async with make_site() as site:
        await page.goto(site.url + "/ui/")
        assert "/ui/sign-in" in page.url  # no key yet
        await page.get_by_label("API key").fill("gpj_" + "A" * 43)
        await page.get_by_role("button", name="Sign in").click()
        await expect(page.locator("#err-key")).to_contain_text("not a valid API key")
        await page.get_by_label("API key").fill(site.user_key)
        await page.get_by_role("button", name="Sign in").click()
        await page.wait_for_url(site.url + "/ui/")
        assert site.user_key not in page.url
        await expect(page.locator("#jobs-body tr.empty")).to_contain_text("No jobs yet")

        # The parameters come from GET /models: the relief model's schema with its defaults.
        await expect(page.get_by_label("resolution", exact=True)).to_have_value("256")
        await expect(page.get_by_label("format", exact=True)).to_have_value("glb")
        await expect(page.locator("#model-hint")).not_to_contain_text("No live worker")  # this one serves it
        await page.set_input_files(
            "#image", files=[{"name": "ramp.png", "mimeType": "image/png", "buffer": ramp_png()}]
        )
        await expect(page.locator("#image-name")).to_contain_text("ramp.png")
        await page.get_by_label("resolution", exact=True).fill("32")
        await page.evaluate("window.sameDocument = true")
        await page.get_by_role("button", name="Submit job").click()

        row = page.locator("#jobs-body tr.job-row")
        await expect(row).to_have_count(1)
        first_state = await row.get_attribute("data-state")
        assert first_state in {"queued", "running"}, first_state  # not finished when it appeared...
        await expect(row.locator(".badge")).to_have_text("succeeded", timeout=30_000)  # ...then live
        assert await page.evaluate("window.sameDocument") is True  # no reload
        assert await row.locator("progress").evaluate("bar => bar.value") == 1
        await expect(row.locator("[data-run]")).not_to_have_text("—")
        await expect(row.get_by_role("button", name=re.compile("Cancel"))).to_have_count(0)

        await row.get_by_role("link").click()
        await page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f-]{36}$"))
        job_id = page.url.rsplit("/", 1)[1]
        viewer = page.locator("#viewer")
        await expect(viewer).to_have_attribute("data-state", "ready", timeout=TIMEOUT_3D_MS)
        canvas = viewer.locator("canvas")
        painted = await canvas.evaluate(PAINTED)
        assert painted["covered"] > 0.05 and painted["colours"] > 20, painted  # a shaded mesh, not blank
        before = await canvas.evaluate("c => c.toDataURL()")
        await canvas.focus()
        await page.keyboard.press("ArrowLeft")
        await page.keyboard.press("+")
        assert await canvas.evaluate("c => c.toDataURL()") != before  # the keyboard turns and zooms it

        await expect(page.locator(".input-image")).to_have_js_property("naturalWidth", 96)
        await expect(page.locator(".kv-table")).to_contain_text("resolution")
        await expect(page.locator("#job-history .events")).to_contain_text("succeeded")
        await expect(page.locator("pre.log")).to_contain_text("PROGRESS")

        async with page.expect_download() as info:
            await page.get_by_role("link", name="Download mesh.glb").click()
        download = await info.value
        path = tmp_path / "mesh.glb"
        await download.save_as(path)
        job = (await site.http.get(f"/jobs/{job_id}")).json()
        assert path.read_bytes()[:4] == b"glTF"
        assert path.stat().st_size == job["files"][0]["bytes"]


TIMEOUT_3D_MS = 30_000


async def test_the_form_checks_like_the_server_and_shows_its_errors_by_the_field(make_site, page):
    async with make_site(max_upload_mb=0.05, priority_max=10) as site:
        posts: list[str] = []
        page.on("request", lambda r: posts.append(r.url) if r.method == "POST" and "/jobs" in r.url else None)
        await page.route("**/models", stale_registry)  # the page sees an older schema than the server
        await sign_in(page, site, site.user_key)

        await drop(page, "notes.png", b"just text, whatever the name says")
        await expect(page.locator("#err-image")).to_contain_text("Not a PNG, JPEG or WebP image")
        await expect(page.locator("#image")).to_have_attribute("aria-invalid", "true")
        big = ramp_png(400, 400) + b"\0" * 60_000  # still a PNG, but over the 0.05 MB limit
        await drop(page, "big.png", big)
        await expect(page.locator("#err-image")).to_contain_text("larger than the 51.2 kB limit")
        await drop(page, "ramp.png", ramp_png())
        await expect(page.locator("#image-name")).to_contain_text("ramp.png")
        await expect(page.locator("#err-image")).to_be_empty()

        resolution = page.get_by_label("resolution", exact=True)
        await resolution.fill("5000")
        await page.get_by_label("Priority").fill("11")
        await page.get_by_role("button", name="Submit job").click()
        await expect(page.locator("[id='err-params.resolution']")).to_have_text("Must be at most 4096")
        await expect(page.locator("#err-priority")).to_contain_text("between -100 and 10")
        await expect(resolution).to_have_attribute("aria-invalid", "true")
        assert posts == []  # refused before sending anything

        await page.get_by_label("Priority").fill("0")
        await resolution.fill("2048")  # fine by the page's schema, not by the server's
        await page.get_by_role("button", name="Submit job").click()
        await expect(page.locator("[id='err-params.resolution']")).to_have_text("Must be at most 1024")
        await expect(resolution).to_have_attribute("aria-invalid", "true")
        await expect(page.locator("#err-priority")).to_be_empty()
        assert len(posts) == 1
        assert (await site.http.get("/jobs")).json()["jobs"] == []  # nothing was queued


async def test_the_form_says_when_no_live_worker_serves_the_chosen_model(make_site, page):
    """The form let a person submit to a model no worker serves, and the job then waited for ever
    with nothing said why. The model's hint now says so (GET /models counts its live workers)."""
    async with make_site(run_worker=False) as site:
        await sign_in(page, site, site.user_key)
        await expect(page.locator("#model-hint")).to_contain_text("No live worker serves this model now")
        await page.locator("#model").select_option("toy")
        await expect(page.locator("#model-hint")).to_contain_text("its jobs wait until one starts")


async def test_a_lost_answer_is_sent_again_with_its_key_and_a_changed_form_with_a_new_one(make_site, page):
    """The server refuses a key reused for another request (409). The page keeps its key while the
    form is unchanged, so resending after a lost answer gets back the job already queued, and it
    takes a new key once anything changed (a key kept until a success made that resend a 409)."""
    async with make_site() as site:
        keys: list[str] = []
        lose = {0, 2}  # the answers to these POSTs never arrive

        async def losing(route: Any) -> None:
            if route.request.method != "POST":
                await route.continue_()
                return
            keys.append(route.request.headers["idempotency-key"])
            answer = await route.fetch()  # the server queues the job...
            if len(keys) - 1 in lose:
                await route.abort("connectionreset")  # ...and its answer is lost
            else:
                await route.fulfill(response=answer)

        async def send(expected_jobs: int) -> None:
            await submit.click()
            await expect(submit).to_be_enabled()
            assert len((await site.http.get("/jobs")).json()["jobs"]) == expected_jobs

        await page.route(re.compile(r".*/jobs$"), losing)
        await sign_in(page, site, site.user_key)
        submit = page.get_by_role("button", name="Submit job")
        await drop(page, "ramp.png", ramp_png())
        await page.get_by_label("resolution", exact=True).fill("32")
        await send(1)  # lost
        await send(1)  # the same form: its key, and the job already queued
        await expect(page.locator("#submit-status")).to_contain_text("queued")
        await drop(page, "ramp.png", ramp_png())
        await page.get_by_label("Priority").fill("3")
        await send(2)  # a new job, answer lost
        await page.get_by_label("Priority").fill("4")
        await send(3)  # changed: a new key, not a 409
        await expect(page.locator("#submit-status")).to_contain_text("queued")
        assert keys[0] == keys[1] and len(set(keys)) == 3
        jobs = (await site.http.get("/jobs")).json()["jobs"]
        assert [j["priority"] for j in jobs] == [4, 3, 0]


async def stale_registry(route: Any) -> None:
    """GET /models as an older registry said it: the relief model took a resolution up to 4096."""
    response = await route.fetch()
    body = await response.json()
    for model in body["models"]:
        if model["name"] == "relief":
            model["params"]["resolution"]["max"] = 4096
    await route.fulfill(response=response, json=body)


async def test_cancel_from_the_list_and_filter_by_state_and_model(make_site, page):
    async with make_site() as site:
        slow = await submit_api(site, sleep=30, steps=30)
        quick = await submit_api(site, steps=1)
        await wait_state(site.http, quick, {"succeeded"})
        await wait_state(site.http, slow, {"running"})
        await sign_in(page, site, site.user_key)

        slow_row, quick_row = page.locator(f"#job-{slow}"), page.locator(f"#job-{quick}")
        await expect(quick_row.locator(".badge")).to_have_text("succeeded")
        await expect(slow_row.locator(".badge")).to_have_text("running")
        await slow_row.get_by_role("button", name=re.compile("Cancel job")).click()
        await expect(slow_row.locator(".badge")).to_have_text("canceled", timeout=15_000)
        await expect(page.locator("#flash")).to_contain_text(slow[:8])
        await expect(slow_row.get_by_role("button")).to_have_count(0)

        await page.locator("#filters select[name=state]").select_option("canceled")
        await page.get_by_role("button", name="Filter").click()
        await expect(page.locator("#jobs-body tr.job-row")).to_have_count(1)
        await expect(page.locator(f"#job-{slow}")).to_be_visible()
        await page.locator("#filters select[name=state]").select_option("failed")
        await page.get_by_role("button", name="Filter").click()
        await expect(page.locator("#jobs-body tr.empty")).to_contain_text("No jobs match these filters")
        await page.locator("#filters select[name=state]").select_option("")
        await page.locator("#filters select[name=model]").select_option("toy")
        await page.get_by_role("button", name="Filter").click()
        await expect(page.locator("#jobs-body tr.job-row")).to_have_count(2)
        await page.locator("#filters select[name=model]").select_option("relief")
        await page.get_by_role("button", name="Filter").click()
        await expect(page.locator("#jobs-body tr.job-row")).to_have_count(0)


async def test_admin_sees_gpus_and_queue_and_retries_failed_jobs(make_site, page):
    async with make_site() as site:
        # Each fails its three attempts (exit code 3), then succeeds once retried (attempt 4).
        failed = [await submit_api(site, fail_attempts=3, steps=1) for _ in range(3)]
        for job_id in failed:
            await wait_state(site.http, job_id, {"failed"})
        await sign_in(page, site, site.admin_key, path="/ui/admin")

        worker = page.locator("#admin-workers article.worker")
        await expect(worker.locator(".badge")).to_have_text("live")
        bar = worker.locator("svg.vram")
        await expect(bar).to_have_attribute("aria-label", re.compile(r"free of 24\.0 GiB"))
        await expect(page.locator("#admin-queue")).to_contain_text("The queue is empty")
        await expect(page.locator("#admin-stats")).to_contain_text("Finished")
        rows = page.locator("#admin-failed tbody tr")
        await expect(rows).to_have_count(3)
        await expect(page.locator(f"#failed-{failed[0]}")).to_contain_text("exit code 3")

        await page.locator(f"#failed-{failed[0]}").get_by_role("button", name=re.compile("Retry job")).click()
        await expect(page.locator("#flash")).to_have_text(f"Job {failed[0][:8]} queued again.")
        first = await wait_state(site.http, failed[0], {"succeeded", "failed"})
        assert first["state"] == "succeeded" and first["attempt"] == 4

        await expect(rows).to_have_count(2)
        for job_id in failed[1:]:
            await page.get_by_label(f"Select job {job_id[:8]}").check()
        await page.get_by_role("button", name="Retry 2 selected").click()
        await expect(page.locator("#flash")).to_have_text("2 of 2 jobs queued again.")
        for job_id in failed[1:]:
            assert (await wait_state(site.http, job_id, {"succeeded", "failed"}))["state"] == "succeeded"
        await expect(page.locator("#admin-failed")).to_contain_text("No failed jobs", timeout=15_000)
        events = (await site.http.get(f"/jobs/{failed[1]}/events")).json()
        assert any(e["kind"] == "retried" and e["detail"].get("by") == "root" for e in events)


async def test_retry_all_says_how_many_the_full_queue_left(make_site, page):
    """The bulk retry stops at the queue limit and says how many it left; the admin page said only
    how many it queued again, as if that were every failed job."""
    async with make_site(run_worker=False, queue_limit=3) as site:
        failed = [await submit_api(site) for _ in range(3)]
        async with site.app.state.engine.begin() as conn:  # failed as a worker leaves them
            await conn.execute(
                text("UPDATE jobs SET state = 'failed', finished_at = now() WHERE id = ANY(:ids)"),
                {"ids": [uuid.UUID(i) for i in failed]},
            )
        await submit_api(site)  # one waits: room for 2 more
        await sign_in(page, site, site.admin_key, path="/ui/admin")
        page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
        await page.get_by_role("button", name="Retry all").click()
        await expect(page.locator("#flash")).to_have_text(
            "2 jobs queued again; 1 left: the queue is full (GPUJOBS_QUEUE_LIMIT). "
            "Retry again once it has room."
        )


async def test_a_phone_sized_list_and_a_keyboard_only_sign_in(make_site, open_context):
    async with make_site() as site:
        job_id = await submit_api(site, steps=1)
        await wait_state(site.http, job_id, {"succeeded"})
        context = await open_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
        page = await context.new_page()
        await page.goto(site.url + "/ui/")
        await expect(page.get_by_label("API key")).to_be_focused()
        await page.keyboard.type(site.user_key)
        await page.keyboard.press("Enter")
        await page.wait_for_url(site.url + "/ui/")

        row = page.locator(f"#job-{job_id}")
        await expect(row.locator(".badge")).to_have_text("succeeded")
        assert await page.locator("#jobs-table thead").is_hidden()  # rows are cards on a phone
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390
        await expect(page.locator("#submit-panel")).not_to_have_attribute("open", "")  # folded away
        await page.locator("#submit-panel summary").focus()
        await page.keyboard.press("Enter")  # a keyboard unfolds it
        await expect(page.locator("#submit-panel")).to_have_attribute("open", "")
        await row.get_by_role("link").click()
        await expect(page.locator("#job-status .badge")).to_have_text("succeeded")
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390


async def test_retry_all_says_how_many_it_left_for_a_model_gone_from_the_registry(make_site, page):
    """Failed jobs of a model the API's registry no longer has are not queued again (no worker of
    it would run them); the bulk retry did not count them, and the page said "0 jobs queued
    again." as good news while they stayed listed as failed. It now says how many and why."""
    async with make_site(run_worker=False) as site:
        failed = [await submit_api(site) for _ in range(2)]
        async with site.app.state.engine.begin() as conn:  # failed, of a model dropped since
            await conn.execute(
                text(
                    "UPDATE jobs SET state = 'failed', model = 'gone', finished_at = now()"
                    " WHERE id = ANY(:ids)"
                ),
                {"ids": [uuid.UUID(i) for i in failed]},
            )
        await sign_in(page, site, site.admin_key, path="/ui/admin")
        page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
        await page.get_by_role("button", name="Retry all").click()
        flash = page.locator("#flash")
        await expect(flash).to_have_text(
            "0 jobs queued again; 2 not: their model is not in the API's model registry. "
            "Add it back to retry them."
        )
        await expect(flash).to_have_class(re.compile(r"\berror\b"))


async def test_an_expired_failed_job_cannot_be_selected_for_a_retry(make_site, page):
    """A failed job that retention expired (its input deleted) had no Retry button, but had a
    checkbox: "Retry selected" took it, and its retry failed with 410 ("1 of 2 jobs queued
    again."). It is still listed, but cannot be selected."""
    async with make_site(run_worker=False) as site:
        failed = [await submit_api(site) for _ in range(2)]
        async with site.app.state.engine.begin() as conn:
            ids = [uuid.UUID(i) for i in failed]
            await conn.execute(
                text("UPDATE jobs SET state = 'failed', finished_at = now() WHERE id = ANY(:ids)"),
                {"ids": ids},
            )
            await conn.execute(text("UPDATE jobs SET expired_at = now() WHERE id = :id"), {"id": ids[0]})
        await sign_in(page, site, site.admin_key, path="/ui/admin")
        await expect(page.locator("#admin-failed tbody tr")).to_have_count(2)
        await expect(page.locator("#admin-failed .select-job")).to_have_count(1)
        await page.locator("#select-all").check()
        await page.get_by_role("button", name="Retry 1 selected").click()
        await expect(page.locator("#flash")).to_have_text("1 of 1 jobs queued again.")
