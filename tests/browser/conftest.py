"""Browser tests: real headless Chromium (Debian's `chromium`) driven by Playwright, against the real
service (uvicorn on a free loopback port, a worker in the same process, a fresh database per test).

No browser is ever downloaded: Playwright launches the `chromium` binary found at
CHROMIUM_PATH (default /usr/bin/chromium; `make browser` installs it). Without it, or without
the `playwright` package, the tests that need a browser skip and say why. One browser serves the
whole session; each test gets its own context (cookies, downloads) and page.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from app.api.main import create_app
from app.settings import Settings
from tests.conftest import create_key, http_client, serving

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",  # a closed network refuses Chromium's own connections
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--use-gl=angle",  # WebGL without a GPU: ANGLE on SwiftShader, so three.js can draw
    "--use-angle=swiftshader",
    "--enable-unsafe-swiftshader",
]
TIMEOUT_MS = 20_000


def chromium_path() -> Path | None:
    """The Chromium binary to drive: CHROMIUM_PATH, /usr/bin/chromium, or `chromium` on PATH."""
    named = os.environ.get("CHROMIUM_PATH")
    if named:
        return Path(named) if Path(named).exists() else None
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    return Path(found) if found else None


def why_no_browser() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing: pip install -e '.[test]'"
    if chromium_path() is None:
        return "no Chromium: `make browser` (apt-get install chromium) installs it; browser tests skipped"
    return None


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    """One headless Chromium for the whole session (skips every browser test when there is none)."""
    reason = why_no_browser()
    if reason is not None:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=str(chromium_path()), args=CHROMIUM_ARGS)
        yield chromium
        await chromium.close()


@dataclass
class Problems:
    """What went wrong inside the page: uncaught script errors and Content-Security-Policy refusals."""

    seen: list[str]

    def watch(self, page: Any) -> None:
        """Record `page`'s script errors and CSP violations."""
        page.on("pageerror", lambda exc: self.seen.append(f"script error: {exc}"))
        page.on(
            "console",
            lambda msg: (
                self.seen.append(f"console: {msg.text}")
                if msg.type == "error" and "Content Security Policy" in msg.text
                else None
            ),
        )


class Contexts:
    """Browser contexts opened by one test; all are closed before its server stops."""

    def __init__(self, browser: Any) -> None:
        self.browser = browser
        self.open: list[Any] = []
        self.problems = Problems([])

    async def __call__(self, **options: Any) -> Any:
        """A fresh context (cookies, downloads) whose pages may raise no script error."""
        options = {"viewport": {"width": 1280, "height": 860}, "accept_downloads": True, **options}
        context = await self.browser.new_context(**options)
        context.set_default_timeout(TIMEOUT_MS)
        context.on("page", self.problems.watch)
        self.open.append(context)
        return context

    async def close(self) -> None:
        """Close every context: their event streams end, so the server can stop at once."""
        while self.open:
            await self.open.pop().close()


@pytest.fixture
async def open_context(browser: Any) -> AsyncIterator[Contexts]:
    """`await open_context(**options)`: a fresh browser context; its pages may raise no script error."""
    contexts = Contexts(browser)
    yield contexts
    await contexts.close()
    assert not contexts.problems.seen, contexts.problems.seen


@pytest.fixture
async def page(open_context: Contexts) -> Any:
    """A laptop-sized page in a fresh context."""
    context = await open_context()
    return await context.new_page()


@dataclass
class Site:
    """The service under test: its URL, keys for a user (alice) and an admin, an admin HTTP client."""

    url: str
    app: Any
    user_key: str
    admin_key: str
    http: httpx.AsyncClient

    def client(self, key: str) -> httpx.AsyncClient:
        """An HTTP client of the API with `key` (close it after use)."""
        return http_client(self.url, key)


@pytest.fixture
def make_site(settings: Settings, open_context: Contexts) -> Callable[..., Any]:
    """`async with make_site(**settings) as site`: the whole service, worker included, on a free port."""

    @contextlib.asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[Site]:
        assert settings.database_url
        user = await create_key(settings.database_url, "alice")
        admin = await create_key(settings.database_url, "root", admin=True)
        app = create_app(settings.model_copy(update={"run_worker": True, **overrides}))
        async with (
            serving(app) as url,
            http_client(url, admin) as http,
        ):
            try:
                yield Site(url, app, user, admin, http)
            finally:
                await open_context.close()

    return make


def ramp_png(width: int = 96, height: int = 64) -> bytes:
    """A brightness ramp with a bump: a relief with something to look at."""
    image = Image.new("L", (width, height))
    cx, cy = width * 0.6, height * 0.5
    image.putdata(
        [
            min(255, int(180 * x / (width - 1) + 90 * max(0.0, 1 - ((x - cx) ** 2 + (y - cy) ** 2) / 300)))
            for y in range(height)
            for x in range(width)
        ]
    )
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


async def sign_in(page: Any, site: Site, key: str, *, path: str = "/ui/") -> None:
    """Open `path`, get sent to the sign-in page, sign in with `key`, and come back to `path`."""
    await page.goto(site.url + path)
    assert "/ui/sign-in" in page.url, page.url
    await page.get_by_label("API key").fill(key)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(site.url + path)
