"""The job page's preview card in a real browser, for a job that ends without a mesh."""

from __future__ import annotations

import pytest

from tests.browser.conftest import sign_in
from tests.browser.test_ui import submit_api, wait_state

expect = pytest.importorskip(
    "playwright.async_api", reason="the playwright package is missing: pip install -e '.[test]'"
).expect


async def test_a_job_that_ends_without_a_mesh_says_so_live(make_site, page):
    """Watched live, a job that succeeded without a mesh file (the toy model writes out.txt) went on
    saying "The preview appears here when the job has succeeded." under its succeeded badge."""
    async with make_site() as site:
        # Long enough to be still running once the browser has signed in and loaded the page.
        job_id = await submit_api(site, sleep=8, steps=4)
        await wait_state(site.http, job_id, {"running"})
        await sign_in(page, site, site.user_key, path=f"/ui/jobs/{job_id}")
        await expect(page.locator("#viewer-empty")).to_have_text(
            "The preview appears here when the job has succeeded."
        )
        await expect(page.locator("#job-state")).to_have_text("succeeded", timeout=30_000)
        await expect(page.locator("#viewer-empty")).to_have_text("This job has no mesh to show.")
        await page.reload()
        await expect(page.locator("#viewer-empty")).to_have_text("This job has no mesh to show.")
