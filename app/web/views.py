"""Rendering: the Jinja2 templates, the pages' Content-Security-Policy, and how values are shown.

Every page and fragment is rendered here with autoescaping on. Pages set their own strict CSP
(`security.SecurityHeaders` keeps a header a route set): scripts, styles, images and connections
from this origin only, no inline script or style, no frames. The page's scripts mirror
`timings()` and `duration()` to keep the times of running jobs ticking (static/js/live.js).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from fastapi.responses import HTMLResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles

from app.queue.jobs import CANCELABLE_STATES, Job, JobState

HERE = Path(__file__).resolve().parent
TEMPLATES_DIR = HERE / "templates"
STATIC_DIR = HERE / "static"
STATIC_URL = "/ui/static"

# blob: images are the preview of a file chosen for upload; blob: connections are three.js loaders
# reading textures embedded in a GLB. Nothing else leaves this origin; nothing inline runs.
PAGE_CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob: data:",
        "connect-src 'self' blob: data:",
        "form-action 'self'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    )
)
ACTIVE = frozenset({JobState.queued, JobState.scheduled, JobState.running})


def duration(seconds: float | None) -> str:
    """A short human duration: 0.4 s, 12 s, 3 min 05 s, 2 h 04 min, 3 d 2 h; a dash for none."""
    if seconds is None or math.isnan(seconds):
        return "—"
    seconds = max(seconds, 0.0)
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    if whole < 86_400:
        return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
    return f"{whole // 86_400} d {whole % 86_400 // 3600} h"


def size(n: int) -> str:
    """Bytes in kB, MB or GB of 1024 (as the upload limit is set and worded: 20 MB = 20 MiB)."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= scale:
            return f"{round(n / scale, 1):g} {unit}"
    return f"{n} B"


def mib(n: int) -> str:
    """GPU memory in MiB, shown in GiB from 1 GiB up."""
    return f"{n / 1024:.1f} GiB" if n >= 1024 else f"{n} MiB"


def iso(moment: datetime | None) -> str:
    """ISO 8601 for `datetime` attributes and the page's scripts; empty for none."""
    return moment.isoformat() if moment is not None else ""


def clock(moment: datetime | None) -> str:
    """A timestamp as people read it, in UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if moment is not None else "—"


def when(moment: datetime | None) -> str:
    """A timestamp to the minute, for lists (UTC; the full one is in its title)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M") if moment is not None else "—"


def short(value: object) -> str:
    """The first 8 characters of a job id: enough to tell jobs apart on a page."""
    return str(value)[:8]


def plain(value: object) -> str:
    """A parameter or detail value as JSON writes it (true, 2.5, glb), strings without quotes."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return str(value)


def timings(job: Job, now: datetime) -> tuple[float | None, float | None]:
    """(wait, run) in seconds: waiting until the last attempt started, running until it ended. A
    job waiting for its next attempt, or that ended so, has waited all along and has no run now."""
    created, started, finished = job.created_at, job.started_at, job.finished_at
    if job.state in (JobState.queued, JobState.scheduled) or started is None or job.ended_waiting:
        end = finished if job.state.final and finished is not None else now
        return (end - created).total_seconds(), None
    wait = (started - created).total_seconds()
    end = now if job.state is JobState.running or finished is None else finished
    return wait, (end - started).total_seconds()


def active(job: Job) -> bool:
    """Whether the job may still change by itself."""
    return job.state in ACTIVE


def cancelable(job: Job) -> bool:
    """Whether a cancel takes the job (its page and row offer one)."""
    return job.state in CANCELABLE_STATES


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        duration=duration, size=size, mib=mib, iso=iso, clock=clock, short=short, plain=plain, when=when
    )
    env.globals.update(timings=timings, active=active, cancelable=cancelable, static=STATIC_URL)
    return env


ENV = _environment()


def render(template: str, *, status_code: int = 200, **context: Any) -> HTMLResponse:
    """A page or fragment from `template`, with the pages' CSP."""
    context.setdefault("now", datetime.now(UTC))
    context.setdefault("status_code", status_code)
    html = ENV.get_template(template).render(**context)
    return HTMLResponse(html, status_code=status_code, headers={"Content-Security-Policy": PAGE_CSP})


class StaticAssets(StaticFiles):
    """The page's CSS, scripts and vendored libraries; cached, but checked again on each use (ETag)."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        """The file, with `Cache-Control: no-cache` (a 304 when unchanged) instead of the API's no-store."""
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response
