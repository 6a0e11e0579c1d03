"""Paths the API does not serve: a 404 that says which path was meant, and when it needs no key."""

from __future__ import annotations

import uuid

from tests.conftest import api_client, client_for, png_bytes


async def test_a_trailing_slash_is_a_404_that_names_the_path_without_it(settings, engine):
    """`curl -F image=@photo.png … /jobs/` got a 307 with an empty body (FastAPI's redirect of a
    path's slash twin): `curl -s` printed nothing, and a client that followed it sent the upload
    twice. Now every method gets a 404 naming the path meant, with a key or without, and no job is
    made; the web page's address without its slash still opens it."""
    from tests.integration.test_security import counts

    async with api_client(settings) as http, client_for(http, None) as anonymous:
        for client in (http, anonymous):
            answer = await client.post(
                "/jobs/", files={"image": ("a.png", png_bytes(), "image/png")}, data={"model": "toy"}
            )
            assert answer.status_code == 404, (answer.status_code, answer.text)
            assert answer.json()["detail"] == "no such path: /jobs/ (did you mean /jobs?)"
        listed = await http.get("/jobs/")
        assert listed.status_code == 404 and "did you mean /jobs?" in listed.json()["detail"]
        page = await http.get("/ui", headers={"Accept": "text/html"})
        assert page.status_code in (303, 307) and page.headers["location"].endswith("/ui/")
    assert (await counts(engine))[0] == 0


async def test_an_unknown_path_is_a_404_without_a_key(settings):
    """/redoc (the README says there is none) and /favicon.ico answered 401 "missing API key", and
    with a key a bare "Not Found". Where the docs are public the paths are no secret: an unknown
    one is a 404 that says where the paths are listed, key or none. A path of a job that does not
    exist still needs a key first (no id is looked up without one); with GPUJOBS_PUBLIC_DOCS=false
    an unknown path needs a key too."""
    async with api_client(settings) as http, client_for(http, None) as anonymous:
        for client in (anonymous, http):
            for path in ("/redoc", "/favicon.ico", "/no/such/path"):
                answer = await client.get(path)
                assert answer.status_code == 404, (path, answer.status_code, answer.text)
                assert (
                    answer.json()["detail"] == f"no such path: {path} (the API's paths are listed at /docs)"
                )
        assert (await anonymous.get(f"/jobs/{uuid.uuid4()}")).status_code == 401
        assert (await http.get(f"/jobs/{uuid.uuid4()}")).status_code == 404
    async with api_client(settings, public_docs=False) as http, client_for(http, None) as anonymous:
        assert (await anonymous.get("/redoc")).status_code == 401
        assert (await http.get("/redoc")).status_code == 404


async def test_a_missing_file_of_the_pages_is_a_404_that_says_so(settings):
    """A file the web page's assets do not have was answered "no such path: … (the API's paths are
    listed at /docs)", which does not apply: the path is the assets' own. It says no such file."""
    from app.web import views

    async with api_client(settings) as http:
        answer = await http.get(f"{views.STATIC_URL}/no-such.js")
    assert answer.status_code == 404, answer.text
    assert answer.json()["detail"] == f"no such file: {views.STATIC_URL}/no-such.js"
