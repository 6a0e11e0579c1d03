"""The web page over plain HTTP (no browser needed): sign-in cookie, CSRF, redirects, CSP, tenants."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from app import storage
from app.api import security
from app.queue.jobs import Job, JobState
from app.web import session, views
from tests.conftest import XRW, api_client, client_for, png_bytes, signed_in

WEB = Path(__file__).resolve().parents[2] / "app" / "web"
JSON = {"content-type": "application/json"}


async def submit(http: httpx.AsyncClient, headers: dict[str, str] | None = None, **params: object) -> str:
    """A toy job through the API (Bearer key, or the cookie with `headers=XRW`); its id."""
    answer = await http.post(
        "/jobs",
        files={"image": ("a.png", png_bytes(), "image/png")},
        data={"model": "toy", "params": json.dumps(params)},
        headers=headers,
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


async def test_a_browser_without_a_key_is_sent_to_sign_in_and_a_script_gets_401(settings):
    async with api_client(settings, key=None) as anonymous:
        root = await anonymous.get("/")
        assert root.status_code == 303 and root.headers["location"] == "/ui/"
        page = await anonymous.get("/ui/jobs/00000000-0000-0000-0000-000000000000?x=1")
        assert page.status_code == 303
        assert (
            page.headers["location"]
            == "/ui/sign-in?next=%2Fui%2Fjobs%2F00000000-0000-0000-0000-000000000000%3Fx%3D1"
        )
        script = await anonymous.get("/ui/", headers=XRW)  # the page's own fetch: no redirect to follow
        assert script.status_code == 401 and "Bearer" in script.headers["www-authenticate"]
        sign_in = await anonymous.get("/ui/sign-in")
        assert sign_in.status_code == 200 and 'id="signin-form"' in sign_in.text
        assert (await anonymous.get("/jobs")).status_code == 401  # the API is as closed as before


async def test_sign_in_keeps_the_key_in_an_httponly_strict_cookie_and_sign_out_forgets_it(settings, make_key):
    alice = await make_key("alice")
    async with api_client(settings, key=None) as browser:
        bad = await signed_in(browser, "gpj_" + "A" * 43)
        assert bad.status_code == 401 and "set-cookie" not in bad.headers
        good = await signed_in(browser, alice)
        assert good.status_code == 200 and good.json() == {"principal": "alice", "admin": False}
        cookie = good.headers["set-cookie"]
        assert cookie.startswith(f"{security.SESSION_COOKIE}={alice};")
        for attribute in ("HttpOnly", "SameSite=strict", "Path=/", f"Max-Age={session.SESSION_MAX_AGE_S}"):
            assert attribute.lower() in cookie.lower(), cookie
        assert "secure" not in cookie.lower()  # plain HTTP here; see the next test

        assert (await browser.get("/jobs")).status_code == 200  # the API takes the cookie
        page = await browser.get("/ui/")
        assert page.status_code == 200 and "Your jobs" in page.text and alice not in page.text
        assert page.headers["content-security-policy"] == views.PAGE_CSP

        gone = await browser.delete("/ui/session", headers=XRW)
        assert gone.status_code == 204 and "Max-Age=0" in gone.headers["set-cookie"]
        assert (await browser.get("/ui/")).status_code == 303


async def test_the_cookie_is_secure_behind_https(settings, make_key):
    alice = await make_key("alice")
    async with api_client(settings, key=None) as browser:
        answer = await browser.post(
            "/ui/session", json={"key": alice}, headers={**XRW, "X-Forwarded-Proto": "https"}
        )
        assert answer.status_code == 200 and "secure" in answer.headers["set-cookie"].lower()


async def test_signing_out_clears_what_the_browser_kept_of_the_callers_jobs(settings, make_key):
    """A job's input image (the job page's <img>) may be kept by the browser for a day without asking
    again (`private, max-age=86400`). Signing out deleted only the cookie, so on a shared computer
    the next person opening /jobs/<id>/input (the id is in the history) saw the image, no key
    needed. Signing out now also tells the browser to drop what it cached of this site."""
    alice = await make_key("alice")
    async with api_client(settings, key=None) as browser:
        await signed_in(browser, alice)
        job_id = await submit(browser, headers=XRW)
        kept = await browser.get(f"/jobs/{job_id}/input")
        assert kept.status_code == 200 and "max-age=86400" in kept.headers["cache-control"]
        gone = await browser.delete("/ui/session", headers=XRW)
        assert gone.status_code == 204 and "Max-Age=0" in gone.headers["set-cookie"]
        assert '"cache"' in gone.headers.get("clear-site-data", ""), gone.headers


async def test_two_session_cookies_sign_the_browser_out_not_in_as_either(settings, make_key):
    """A sibling subdomain can set `gpujobs_key` for the parent domain (cookie tossing): the browser
    then sent both cookies, the last one won, and the victim was signed in as the attacker (and
    uploaded to the attacker's account). Now two session cookies are no session at all."""
    victim, attacker = await make_key("victim"), await make_key("attacker")
    name = security.SESSION_COOKIE
    both = {"Cookie": f"{name}={victim}; theme=dark; {name}={attacker}"}
    async with api_client(settings, key=None) as browser:
        page = await browser.get("/ui/", headers=both)
        assert page.status_code == 303 and page.headers["location"].startswith("/ui/sign-in")
        script = await browser.get("/jobs", headers={**both, **XRW})
        assert script.status_code == 401 and "two session cookies" in script.json()["detail"]
        sign_in = await browser.get("/ui/sign-in", headers=both)
        assert sign_in.status_code == 200 and "two session cookies" in sign_in.text
        again = await browser.post("/ui/session", json={"key": victim}, headers={**both, **XRW})
        assert again.status_code == 409 and "two session cookies" in again.json()["detail"]
        assert "set-cookie" not in again.headers
        one = await browser.get("/ui/", headers={"Cookie": f"theme=dark; {name}={victim}"})
        assert one.status_code == 200 and 'title="Signed in as victim"' in one.text


async def test_over_https_the_cookie_is_host_only_and_a_parent_domain_one_is_ignored(settings, make_key):
    """Over HTTPS the cookie is `__Host-` prefixed, which a browser never takes with a Domain: a
    sibling's `gpujobs_key` for the parent domain is not the session and changes nothing."""
    victim, attacker = await make_key("victim"), await make_key("attacker")
    https = {"X-Forwarded-Proto": "https"}
    async with api_client(settings, key=None) as browser:
        answer = await browser.post("/ui/session", json={"key": victim}, headers={**XRW, **https})
        cookie = answer.headers["set-cookie"]
        assert cookie.startswith(f"__Host-{security.SESSION_COOKIE}={victim};"), cookie
        assert "secure" in cookie.lower() and "Path=/" in cookie and "domain" not in cookie.lower()
        name = security.SESSION_COOKIE
        tossed = {"Cookie": f"__Host-{name}={victim}; {name}={attacker}"}
        page = await browser.get("/ui/", headers={**tossed, **https})
        assert page.status_code == 200 and 'title="Signed in as victim"' in page.text
        alone = {"Cookie": f"{security.SESSION_COOKIE}={attacker}", **https}
        assert (await browser.get("/ui/", headers=alone)).status_code == 303  # not signed in as the attacker
        gone = await browser.delete("/ui/session", headers={**XRW, **https})
        assert gone.headers["set-cookie"].startswith(f"__Host-{security.SESSION_COOKIE}=")


async def test_changes_signed_in_by_the_cookie_need_x_requested_with(settings, make_key):
    alice = await make_key("alice")
    async with api_client(settings, key=alice) as api:
        job_id = await submit(api, sleep=30)
        async with client_for(api, None) as browser:
            assert (await browser.post("/ui/session", json={"key": alice})).status_code == 403  # login CSRF
            await signed_in(browser, alice)
            forged = await browser.post(f"/jobs/{job_id}/cancel")  # what a form on another site sends
            assert forged.status_code == 403 and forged.json()["detail"] == security.CROSS_SITE
            assert (await api.get(f"/jobs/{job_id}")).json()["state"] == "queued"
            upload = await browser.post(
                "/jobs", files={"image": ("a.png", png_bytes(), "image/png")}, data={"model": "toy"}
            )
            assert upload.status_code == 403
            assert (await browser.delete("/ui/session")).status_code == 403  # no forced sign-out either
            ours = await browser.post(f"/jobs/{job_id}/cancel", headers=XRW)
            assert ours.status_code == 200 and ours.json()["state"] == "canceled"
        # A Bearer key is no cookie: API clients need no extra header.
        assert (await api.post(f"/jobs/{await submit(api)}/cancel")).status_code in (200, 409)


async def test_a_sign_in_without_x_requested_with_is_told_what_a_sign_in_needs(settings, make_key):
    """POST /ui/session without X-Requested-With was told "a request signed in by the web page's
    cookie must carry X-Requested-With", though a sign-in has no cookie yet: the message now speaks
    of signing in (and out), and still names the header."""
    alice = await make_key("alice")
    async with api_client(settings, key=None) as browser:
        for method, body in (("POST", {"key": alice}), ("DELETE", None)):
            refused = await browser.request(method, "/ui/session", json=body)
            detail = refused.json()["detail"]
            assert refused.status_code == 403 and "cookie" not in detail, detail
            assert "X-Requested-With" in detail and detail == session.SESSION_CROSS_SITE, detail


async def test_a_large_sign_in_body_is_refused_before_it_is_parsed(settings, make_key):
    """The sign-in route needs no key, yet took bodies up to the 20 MB upload limit and parsed them
    as JSON first: one anonymous body of `[{},{},...]` held the event loop for 18 s, took 1.5 GB,
    and its 422 sent the whole body back. Now a body over the route's few kB is 413, unread."""
    alice = await make_key("alice")
    flood = b"[" + b"{}," * (1 << 20) + b"{}]"  # 3 MB of objects for the parser to build
    async with api_client(settings, key=None) as browser:
        declared = await browser.post("/ui/session", content=flood, headers={**XRW, **JSON})
        assert declared.status_code == 413, declared.text[:200]
        assert "sign-in" in declared.json()["detail"] and len(declared.content) < 200

        async def streamed() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            for start in range(0, len(flood), 64 << 10):
                yield flood[start : start + (64 << 10)]

        chunked = await browser.post("/ui/session", content=streamed(), headers={**XRW, **JSON})
        assert chunked.status_code == 413 and len(chunked.content) < 200
        assert (await signed_in(browser, alice)).status_code == 200  # a real sign-in still fits


async def test_a_refused_sign_in_does_not_echo_the_key(settings):
    """A 422 copied the refused input back: for the sign-in, the key itself."""
    secret = "gpj_" + "S" * 43
    async with api_client(settings, key=None) as browser:
        for body in ({"key": [secret]}, {"key": secret * 3}, {"Key": secret}):
            refused = await browser.post("/ui/session", json=body, headers=XRW)
            assert refused.status_code == 422, refused.text
            assert "SSSS" not in refused.text and refused.json()["detail"][0]["loc"][-1] == "key"
        form = await browser.post("/ui/session", data={"key": secret}, headers=XRW)  # not JSON: the body
        assert form.status_code == 422 and "SSSS" not in form.text, form.text


class Forms(HTMLParser):
    """The attributes of each <form> of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "form":
            self.found.append(dict(attrs))


async def test_the_sign_in_form_never_puts_the_key_in_a_url(settings):
    """The sign-in form had no method, so a browser that submitted it before its script ran (a slow
    network, a password manager filling the key and pressing Enter) or without scripts sent
    `GET /ui/sign-in?key=gpj_...`: the key in the address bar, the history and the access log of a
    proxy in front. The form posts now: the key goes in the body, which is refused there, unread."""
    secret = "gpj_" + "S" * 43
    async with api_client(settings, key=None) as browser:
        forms = Forms()
        forms.feed((await browser.get("/ui/sign-in")).text)
        [form] = [f for f in forms.found if f.get("id") == "signin-form"]
        assert (form.get("method") or "get").lower() == "post", form
        action = form.get("action") or "/ui/sign-in"
        posted = await browser.post(action, data={"key": secret})  # what such a browser sends
        assert posted.status_code == 403 and "set-cookie" not in posted.headers
        assert "SSSS" not in posted.text


async def test_pages_have_a_strict_csp_and_static_assets_need_no_key(settings):
    async with api_client(settings, key=None) as anonymous:
        page = await anonymous.get("/ui/sign-in")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert "frame-ancestors 'none'" in csp and page.headers["x-frame-options"] == "DENY"
        assert "<script>" not in page.text and " style=" not in page.text  # nothing inline
        for asset in ("js/jobs.js", "js/viewer.js", "css/app.css", "vendor/three/three.module.min.js"):
            answer = await anonymous.get(f"/ui/static/{asset}")
            assert answer.status_code == 200, asset
            assert answer.headers["cache-control"] == "no-cache" and answer.headers["etag"]
        js = await anonymous.get("/ui/static/js/viewer.js")
        assert js.headers["content-type"].startswith(("text/javascript", "application/javascript"))
        assert (await anonymous.get("/ui/static/..%2Fpages.py")).status_code == 404
        assert (await anonymous.get("/ui/static/nothing.js")).status_code == 404


def test_nothing_is_loaded_from_another_site():
    """No CDN: every script, style and module the page loads is a file of the package."""
    remote = re.compile(
        r"""(src|href)=["']https?://|^\s*(import|export)\b[^;]*?from\s*["']https?://"""
        r"""|import\(\s*["']https?://|url\(["']?https?://""",
        re.MULTILINE,
    )
    files = [p for p in WEB.rglob("*") if p.suffix in {".html", ".js", ".css"}]
    assert len(files) > 10
    offenders = [str(p) for p in files if remote.search(p.read_text(encoding="utf-8", errors="replace"))]
    assert offenders == []
    swagger = WEB / "static" / "vendor" / "swagger-ui"
    wanted = {"LICENSE", "NOTICE", "swagger-ui-bundle.js", "swagger-ui.css"}  # served by /docs
    assert wanted <= {p.name for p in swagger.iterdir()}
    vendored = WEB / "static" / "vendor" / "three"
    assert (vendored / "LICENSE").is_file() and (vendored / "three.core.min.js").is_file()
    bare = re.compile(r"""from\s+["']three["']""")  # every import resolves to a vendored file
    assert not [p for p in vendored.rglob("*.js") if bare.search(p.read_text(encoding="utf-8"))]


async def test_pages_show_only_the_callers_jobs(settings, make_key, make_worker):
    alice, bob = await make_key("alice"), await make_key("bob")
    async with api_client(settings, key=alice) as api:
        job_id = await submit(api)
        await make_worker().run()
        async with client_for(api, None) as browser:
            await signed_in(browser, bob)
            for path in ("", "/row", "/live", "/files/out.txt"):
                answer = await browser.get(f"/ui/jobs/{job_id}{path}")
                assert answer.status_code == 404, path
                assert "text/html" in answer.headers["content-type"] and "Not found" in answer.text
            assert job_id not in (await browser.get("/ui/")).text
            await signed_in(browser, alice)
            assert job_id in (await browser.get("/ui/")).text
            page = await browser.get(f"/ui/jobs/{job_id}")
            assert page.status_code == 200 and "Download out.txt" in page.text
            download = await browser.get(f"/ui/jobs/{job_id}/files/out.txt")
            assert download.status_code == 303 and download.headers["location"].startswith(
                f"/files/{job_id}/"
            )
            link = await browser.get(download.headers["location"])
            assert link.status_code == 200 and link.text.startswith("done")
            for name in ("link_secret", "attempt-9.log"):
                assert (await browser.get(f"/ui/jobs/{job_id}/files/{name}")).status_code == 404
            assert (await browser.get(f"/ui/jobs/{uuid.uuid4()}")).status_code == 404
            assert (await browser.get("/ui/jobs/not-a-job-id")).status_code == 404  # a page, not a 422


async def test_a_log_of_progress_bars_shows_its_end_not_empty(settings, make_key, make_worker):
    """A model that draws a progress bar (tqdm: `\r` and no line break) prints over 64 kB without a
    `\n`. The job page showed the log's last 64 kB from its first whole line, and, with no line
    break in them, showed nothing: "(empty: the model has printed nothing)". Now it shows them."""
    key = await make_key("alice")
    async with api_client(settings, key=key) as api:
        job_id = await submit(api)
        await make_worker().run()
        path = storage.log_file(settings.storage_dir.resolve(), uuid.UUID(job_id), 1)
        with path.open("ab") as f:
            for step in range(3000):
                f.write(f"\rsampling {step:4d}/3000 |{'#' * (step // 100):<30}|".encode())
        async with client_for(api, None) as browser:
            await signed_in(browser, key)
            page = await browser.get(f"/ui/jobs/{job_id}")
    assert page.status_code == 200
    assert "sampling 2999/3000" in page.text and "printed nothing" not in page.text
    assert "The last 64 kB of the log." in page.text


async def test_the_admin_page_is_for_admins(settings, make_key):
    alice, root = await make_key("alice"), await make_key("root", admin=True)
    async with api_client(settings, key=None) as browser:
        await signed_in(browser, alice)
        refused = await browser.get("/ui/admin")
        assert refused.status_code == 403 and "admin key" in refused.text
        assert (await browser.get("/ui/admin/live")).status_code == 403
        assert 'href="/ui/admin"' not in (await browser.get("/ui/")).text
        await signed_in(browser, root)
        page = await browser.get("/ui/admin")
        assert page.status_code == 200 and "No failed jobs" in page.text and "The queue is empty" in page.text


async def test_bad_filters_and_cursors_show_a_page_not_a_crash(settings, make_key):
    alice = await make_key("alice")
    async with api_client(settings, key=None) as browser:
        await signed_in(browser, alice)
        ignored = await browser.get("/ui/?state=nonsense&model=nope")
        assert ignored.status_code == 200 and "No jobs yet" in ignored.text
        stale = await browser.get("/ui/?cursor=not-a-cursor")
        assert stale.status_code == 422 and "cursor" in stale.text


async def test_long_urls_and_filters_show_a_page_never_raw_json(settings, make_key):
    """A signed-out browser opening a /ui URL over 500 characters was sent to the sign-in page with
    it as `next`, which answered a raw JSON 422 (`next` too long) instead of the form; a state over
    20 characters, a model over 64 or a cursor over 200 got the same JSON instead of the page."""
    alice = await make_key("alice")
    async with api_client(settings, key=None) as browser:
        page = await browser.get("/ui/jobs/" + "a" * 600)
        assert page.status_code == 303 and page.headers["location"] == security.SIGN_IN_PATH
        form = await browser.get("/ui/sign-in", params={"next": "/ui/jobs/" + "a" * 600})
        assert form.status_code == 200 and 'id="signin-form"' in form.text, form.text[:200]
        assert f'data-next="{session.HOME}"' in form.text
        await signed_in(browser, alice)
        ignored = await browser.get("/ui/", params={"state": "x" * 30, "model": "x" * 70})
        assert ignored.status_code == 200 and "No jobs yet" in ignored.text
        cursor = await browser.get("/ui/", params={"cursor": "x" * 300})
        assert cursor.status_code == 422 and cursor.headers["content-type"].startswith("text/html")
        assert "cursor" in cursor.text


async def test_a_mistyped_page_address_shows_the_not_found_page(settings, make_key):
    """A signed-in browser opening a /ui address no route serves (the list typed as /ui/jobs, a job
    link copied with a slash too many) got the API's JSON 404, pointing at /docs, where a job that
    does not exist gets the page's own "Not found" with its way back. Scripts still get JSON."""
    alice = await make_key("alice")
    async with api_client(settings, key=alice) as api:
        job_id = await submit(api)
        async with client_for(api, None) as browser:
            await signed_in(browser, alice)
            for path, said in [
                ("/ui/jobs", "no such page: /ui/jobs<"),
                (
                    f"/ui/jobs/{job_id}/",
                    f"no such page: /ui/jobs/{job_id}/ (did you mean /ui/jobs/{job_id}?)",
                ),
                ("/ui/admin/", "no such page: /ui/admin/ (did you mean /ui/admin?)"),
            ]:
                page = await browser.get(path)
                assert page.status_code == 404 and page.headers["content-type"].startswith("text/html"), path
                assert said in page.text and 'href="/ui/"' in page.text, page.text
                assert "alice" in page.text  # the menu of a signed-in page
            script = await browser.get("/ui/jobs", headers=XRW)
            assert script.status_code == 404 and script.json()["detail"].startswith("no such path: /ui/jobs")
            missing_asset = await browser.get("/ui/static/none.css")
            assert missing_asset.json()["detail"] == "no such file: /ui/static/none.css"
        assert (await api.get("/nowhere")).json()["detail"].endswith("(the API's paths are listed at /docs)")


async def test_every_page_answers_head_as_its_get(settings, make_key):
    """The job page, its fragments and the admin page answered a signed-in HEAD with a JSON 405,
    where a signed-out HEAD was sent to sign in like a GET (link checkers and monitors send HEAD)."""
    root = await make_key("root", admin=True)
    async with api_client(settings, key=root) as api:
        job_id = await submit(api)
        async with client_for(api, None) as browser:
            assert (await browser.head(f"/ui/jobs/{job_id}")).status_code == 303  # signed out: sign in
            await signed_in(browser, root)
            paths = ["/ui/", f"/ui/jobs/{job_id}", f"/ui/jobs/{job_id}/live", f"/ui/jobs/{job_id}/row"]
            for path in [*paths, "/ui/admin", "/ui/admin/live", f"/ui/jobs/{job_id}/files/input"]:
                got, head = await browser.get(path), await browser.head(path)
                assert (head.status_code, head.content) == (got.status_code, b""), (path, head.status_code)
                for name in ("content-type", "location", "content-security-policy"):
                    assert head.headers.get(name) == got.headers.get(name), (path, name)


async def test_a_quarantined_jobs_page_offers_its_cancel(settings, make_key, engine):
    """A quarantined job is canceled to dismiss it (README, "HTTP API"): its page offers that."""
    alice = await make_key("alice")
    async with api_client(settings, key=alice) as api:
        job_id = await submit(api)
        async with client_for(api, None) as browser:
            await signed_in(browser, alice)
            assert 'data-action="cancel"' in (await browser.get(f"/ui/jobs/{job_id}")).text  # queued
            async with engine.begin() as conn:
                await conn.execute(
                    text("UPDATE jobs SET state = 'quarantined', finished_at = now() WHERE id = :id"),
                    {"id": job_id},
                )
            page = (await browser.get(f"/ui/jobs/{job_id}")).text
            assert 'data-action="cancel"' in page and "Retry job" not in page  # alice is no admin
            assert 'data-action="cancel"' in (await browser.get(f"/ui/jobs/{job_id}/row")).text
            await api.post(f"/jobs/{job_id}/cancel")
            assert 'data-action="cancel"' not in (await browser.get(f"/ui/jobs/{job_id}")).text


def test_the_page_routes_are_not_in_the_api_document(settings):
    from app.api.main import create_app

    assert not [p for p in create_app(settings).openapi()["paths"] if p == "/" or p.startswith("/ui")]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/ui/jobs/abc?state=failed", "/ui/jobs/abc?state=failed"),
        ("/ui/admin", "/ui/admin"),
        ("https://evil.example/ui/", "/ui/"),
        ("//evil.example/ui/", "/ui/"),
        ("/ui//evil.example", "/ui/"),
        ("/docs", "/ui/"),
        ("/ui/\\evil", "/ui/"),
        ("/ui/../docs", "/ui/"),  # a browser resolves the dot segments: /docs
        ("/ui/./../admin/stats", "/ui/"),
        ("/ui/%2e%2e/metrics", "/ui/"),
        ("/ui/jobs/..", "/ui/"),
        ("/ui/jobs/mesh.v2..glb?x=..", "/ui/jobs/mesh.v2..glb?x=.."),  # dots inside a name are fine
        (None, "/ui/"),
        ("/ui/jobs/" + "a" * 600, "/ui/"),  # too long to be one of ours
    ],
)
def test_after_sign_in_only_pages_of_this_site(target, expected):
    assert session.safe_next(target) == expected


def test_times_are_shown_as_people_read_them():
    assert [views.duration(s) for s in (None, 0.04, 9.94, 12.7, 185, 7440, 93_600)] == [
        "—",
        "0.0 s",
        "9.9 s",
        "12 s",
        "3 min 05 s",
        "2 h 04 min",
        "1 d 2 h",
    ]
    assert views.size(20 * 1024 * 1024) == "20 MB" and views.size(52_428) == "51.2 kB"


def test_wait_and_run_times():
    created = datetime(2026, 1, 1, tzinfo=UTC)
    now = created + timedelta(seconds=100)

    def at(seconds: float | None) -> datetime | None:
        return None if seconds is None else created + timedelta(seconds=seconds)

    def job(state: JobState, started: float | None, finished: float | None, run_after: float = 0) -> Job:
        return Job(
            uuid.uuid4(), "tester", "toy", {}, None, 0.1, 0, 1000, state, 1, 3, at(run_after), None,
            None, None, None, None, 0, 1000, None, 0, 0, 0.0, None, None, False, None, created,
            at(started), at(finished),
        )  # fmt: skip

    cases = {
        (JobState.queued, None, None, 0): (100, None),
        (JobState.running, 10, None, 0): (10, 90),
        (JobState.succeeded, 10, 40, 0): (10, 30),
        (JobState.canceled, None, 5, 0): (5, None),
        (JobState.scheduled, 10, 20, 50): (100, None),  # waiting for its retry
        (JobState.canceled, 10, 30, 50): (30, None),  # canceled while waiting for its retry
        (JobState.canceled, 60, 70, 50): (60, 10),  # canceled in its retry's run
    }
    for (state, started, finished, run_after), expected in cases.items():
        assert views.timings(job(state, started, finished, run_after), now) == expected
