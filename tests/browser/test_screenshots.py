"""The README's screenshots, taken by the browser from a realistic service (not run by default).

UI_SCREENSHOTS=docs/screenshots .venv/bin/python -m pytest tests/browser/test_screenshots.py
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw, ImageFilter

from tests.browser.conftest import Site, sign_in
from tests.browser.test_ui import expect, submit_api, wait_state

TARGET = os.environ.get("UI_SCREENSHOTS")
pytestmark = pytest.mark.skipif(not TARGET, reason="set UI_SCREENSHOTS=<folder> to take the screenshots")


def emblem_png(size: int = 320) -> bytes:
    """A round emblem with a mountain and a sun: a relief worth looking at."""
    image = Image.new("L", (size, size), 30)
    draw = ImageDraw.Draw(image)
    draw.ellipse((12, 12, size - 12, size - 12), fill=150)
    draw.ellipse((34, 34, size - 34, size - 34), fill=90)
    draw.polygon([(60, 230), (140, 100), (185, 165), (215, 130), (270, 230)], fill=235)
    draw.ellipse((200, 70, 250, 120), fill=255)
    draw.rectangle((60, 232, 260, 246), fill=200)
    image = image.filter(ImageFilter.GaussianBlur(2))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


async def submit_relief(site: Site, **params: Any) -> str:
    """A relief job of the emblem, as alice."""
    async with site.client(site.user_key) as alice:
        answer = await alice.post(
            "/jobs",
            files={"image": ("emblem.png", emblem_png(), "image/png")},
            data={"model": "relief", "params": json.dumps(params)},
        )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


async def shoot(target: Any, name: str, **options: Any) -> None:
    """Save a screenshot of a page or element as `name`.png, in 256 colours to keep it small."""
    assert TARGET
    picture = Image.open(io.BytesIO(await target.screenshot(**options)))
    path = Path(TARGET) / f"{name}.png"
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    quantized = picture.convert("RGB").quantize(
        colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
    )
    await asyncio.to_thread(quantized.save, path, optimize=True)


async def test_take_the_readme_screenshots(make_site, open_context):
    async with make_site(max_jobs_per_gpu=2, shutdown_grace_s=0.5) as site:
        mesh = await submit_relief(site, resolution=160, depth_mm=8, smoothing=1.5)
        await wait_state(site.http, mesh, {"succeeded"}, timeout_s=60)
        await submit_api(site, steps=1)
        failing = await submit_api(site, fail_attempts=3, steps=1)
        await wait_state(site.http, failing, {"failed"})
        await submit_api(site, sleep=60, steps=60)
        canceled = await submit_api(site, sleep=60, steps=60)
        await site.http.post(f"/jobs/{canceled}/cancel")
        await submit_api(site, sleep=60, steps=60)
        await submit_relief(site, resolution=64)
        await asyncio.sleep(2.5)  # the slow jobs get going

        context = await open_context(viewport={"width": 1280, "height": 800})
        page = await context.new_page()
        await sign_in(page, site, site.user_key)
        await expect(page.get_by_label("resolution", exact=True)).to_be_visible()
        await expect(page.locator("#live-status")).to_have_text("Live")
        await shoot(page, "jobs")
        await page.set_input_files(
            "#image", files=[{"name": "emblem.png", "mimeType": "image/png", "buffer": emblem_png()}]
        )
        await page.get_by_label("resolution", exact=True).fill("5000")
        await page.get_by_role("button", name="Submit job").click()
        await expect(page.locator("[id='err-params.resolution']")).to_be_visible()
        await shoot(page.locator(".submit-card"), "submit")

        await page.goto(f"{site.url}/ui/jobs/{mesh}")
        await expect(page.locator("#viewer")).to_have_attribute("data-state", "ready", timeout=30_000)
        await shoot(page, "job")

        admin = await (await open_context(viewport={"width": 1280, "height": 900})).new_page()
        await sign_in(admin, site, site.admin_key, path="/ui/admin")
        await shoot(admin, "admin", full_page=True)

        phone = await (
            await open_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
        ).new_page()
        await sign_in(phone, site, site.user_key)
        await expect(phone.locator("#live-status")).to_have_text("Live")
        await shoot(phone, "phone-jobs")
