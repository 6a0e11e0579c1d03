"""The API's documentation page, `/docs`: Swagger UI from the package's own copy, under a strict CSP.

FastAPI's own page loads Swagger UI from a CDN (a floating major version, no integrity check) on the
origin of the web page's session cookie, so a changed file there could act as any signed-in admin.
This one loads swagger-ui-dist from `app/web/static/vendor/swagger-ui/` (one pinned version; docs/ui.md
says how to update it), and its CSP runs the scripts of this origin only, plus FastAPI's inline
start-up script by its hash. ReDoc (`/redoc`) is not served: it would need a second vendored bundle.
"""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from app.web import views

router = APIRouter(include_in_schema=False)

DOCS_PATH = "/docs"
VENDOR_URL = f"{views.STATIC_URL}/vendor/swagger-ui"
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def policy(html: str) -> str:
    """The page's CSP: nothing from another origin; of inline scripts, only those of `html`."""
    hashes = "".join(f" 'sha256-{_sha256(script)}'" for script in _INLINE_SCRIPT.findall(html))
    return "; ".join(
        (
            "default-src 'none'",
            f"script-src 'self'{hashes}",
            "style-src 'self' 'unsafe-inline'",  # Swagger UI sets style attributes; styles run no code
            "img-src 'self' data: blob:",  # its icons are data: URLs; an image answer is shown as a blob:
            "connect-src 'self'",
            "form-action 'self'",
            "base-uri 'none'",
            "frame-ancestors 'none'",
        )
    )


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


@router.get(DOCS_PATH)
async def swagger_ui(request: Request) -> HTMLResponse:
    """The interactive API documentation (Swagger UI)."""
    app = request.app
    page = get_swagger_ui_html(
        openapi_url=request.scope.get("root_path", "") + app.openapi_url,
        title=f"{app.title} - Swagger UI",
        swagger_js_url=f"{VENDOR_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{VENDOR_URL}/swagger-ui.css",
        swagger_favicon_url=f"{views.STATIC_URL}/icon.svg",
        swagger_ui_parameters=app.swagger_ui_parameters,
    )
    page.headers["Content-Security-Policy"] = policy(bytes(page.body).decode())
    return page


# HEAD where GET answers (RFC 9110), for the monitors that check the documentation's address so.
router.add_api_route(DOCS_PATH, swagger_ui, methods=["HEAD"])
