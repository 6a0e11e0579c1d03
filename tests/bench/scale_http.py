"""Request latencies of a running API on a big database: the reads users and operators make.

Run on demand, never by pytest, against a `gpujobs serve --no-worker` started just before (so that
its first GET /metrics is a new process's first) on a database that holds a long history
(`tests/bench/scale_db.py` builds one):

    .venv/bin/python -m tests.bench.scale_http --url http://127.0.0.1:8765 \
        --admin-key KEY --user-key KEY --database-url postgresql://...

It prints the median and the slowest of `--repeat` requests per path, and asserts nothing. With
`--catch-up-s S` it scrapes /metrics once a second after the first, up to S seconds, until the job
counters show every job (a new process reads the whole history first). With `--prune-days D` it
also times one POST /admin/prune of what finished more than D days ago (real: it expires them).
See tests/bench/README.md, "Scale".
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import time
from typing import Any

import asyncpg
import httpx
from PIL import Image


def cursor_at(database_url: str, offset: int, owner: str | None = None, state: str | None = None) -> str:
    """The cursor a client holds after `offset` jobs of a listing (newest first)."""

    async def read() -> Any:
        conn = await asyncpg.connect(database_url)
        try:
            return await conn.fetchrow(
                """
                SELECT created_at, id FROM jobs
                WHERE ($1::text IS NULL OR owner = $1) AND ($2::text IS NULL OR state::text = $2)
                ORDER BY created_at DESC, id DESC OFFSET $3 LIMIT 1
                """,
                owner,
                state,
                offset,
            )
        finally:
            await conn.close()

    row = asyncio.run(read())
    raw = f"{row['created_at'].isoformat()}|{row['id']}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def submitted(metrics: str) -> int:
    """The sum of gpujobs_jobs_submitted_total over models."""
    lines = [line for line in metrics.splitlines() if line.startswith("gpujobs_jobs_submitted_total{")]
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines))


def jobs_in(database_url: str) -> int:
    """Jobs in the database."""

    async def count() -> int:
        conn = await asyncpg.connect(database_url)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM jobs"))
        finally:
            await conn.close()

    return asyncio.run(count())


def catch_up(admin: httpx.Client, counted: int, jobs: int, limit_s: float) -> None:
    """Scrape until the job counters show every job submitted (or `limit_s` passed)."""
    start, scrapes = time.perf_counter(), 1
    while counted < jobs and time.perf_counter() - start < limit_s:
        time.sleep(1)
        counted, scrapes = submitted(admin.get("/metrics").text), scrapes + 1
    took = time.perf_counter() - start
    print(f"  {counted} of {jobs} jobs counted after {scrapes} scrapes, {took:.0f} s")


def timed(http: httpx.Client, method: str, path: str, repeat: int, **kwargs: Any) -> tuple[list[float], Any]:
    """Milliseconds of `repeat` requests, and the last response's JSON (or None)."""
    took, response = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        response = http.request(method, path, **kwargs)
        took.append((time.perf_counter() - start) * 1000)
        assert response.status_code < 400, (path, response.status_code, response.text[:300])
    assert response is not None
    is_json = response.headers.get("content-type", "").startswith("application/json")
    return took, response.json() if is_json else None


def report(name: str, took: list[float]) -> None:
    """One line: median and slowest."""
    print(f"{name:<44} median {statistics.median(took):8.1f} ms   max {max(took):8.1f} ms   n={len(took)}")


def png() -> bytes:
    """A small PNG to upload."""
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 30, 200)).save(out, "PNG")
    return out.getvalue()


def main() -> None:
    """Time each path."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--admin-key", required=True)
    parser.add_argument("--user-key", required=True)
    parser.add_argument("--user", default="owner-7", help="the principal of --user-key")
    parser.add_argument("--database-url", required=True, help="postgresql://... (to build deep cursors)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--prune-days", type=float, default=None)
    parser.add_argument("--catch-up-s", type=float, default=0, help="scrape until the counters show it all")
    args = parser.parse_args()
    admin = httpx.Client(
        base_url=args.url, headers={"Authorization": f"Bearer {args.admin_key}"}, timeout=120
    )
    user = httpx.Client(base_url=args.url, headers={"Authorization": f"Bearer {args.user_key}"}, timeout=120)
    n = args.repeat

    start = time.perf_counter()
    first = admin.get("/metrics")
    report("GET /metrics (first scrape of this process)", [(time.perf_counter() - start) * 1000])
    catch_up(admin, submitted(first.text), jobs_in(args.database_url), args.catch_up_s)
    report("GET /metrics (later scrapes)", timed(admin, "GET", "/metrics", n)[0])
    report("GET /readyz", timed(admin, "GET", "/readyz", n)[0])
    report("GET /admin/stats", timed(admin, "GET", "/admin/stats", n)[0])
    report("GET /admin/workers", timed(admin, "GET", "/admin/workers", n)[0])
    image = png()
    took, job = timed(
        user, "POST", "/jobs", n, files={"image": ("a.png", image, "image/png")}, data={"model": "relief"}
    )
    report("POST /jobs", took)
    report("GET /jobs/{id}", timed(user, "GET", f"/jobs/{job['id']}", n)[0])
    report("GET /jobs/{id}/events", timed(user, "GET", f"/jobs/{job['id']}/events", n)[0])
    deep_user = cursor_at(args.database_url, 3000, owner=args.user)
    page2_user = cursor_at(args.database_url, 50, owner=args.user)
    deep_all = cursor_at(args.database_url, 900_000)
    page2_all = cursor_at(args.database_url, 50)
    deep_failed = cursor_at(args.database_url, 50_000, state="failed")
    lists = [
        ("(user)", user, ""),
        ("?state=failed (user)", user, "?state=failed"),
        ("?state=queued (user)", user, "?state=queued"),
        ("?model=relief (user)", user, "?model=relief"),
        ("?cursor=(page 2) (user)", user, f"?cursor={page2_user}"),
        ("?cursor=(job 3,000) (user)", user, f"?cursor={deep_user}"),
        ("(admin)", admin, ""),
        ("?state=failed (admin)", admin, "?state=failed"),
        ("?state=quarantined (admin)", admin, "?state=quarantined"),
        ("?state=queued (admin)", admin, "?state=queued"),
        ("?model=depth (admin)", admin, "?model=depth"),
        ("?cursor=(page 2) (admin)", admin, f"?cursor={page2_all}"),
        ("?cursor=(job 900,000) (admin)", admin, f"?cursor={deep_all}"),
        ("?state=failed&cursor=(job 50,000) (admin)", admin, f"?state=failed&cursor={deep_failed}"),
    ]
    for label, http, query in lists:
        report(f"GET /jobs{label}", timed(http, "GET", f"/jobs{query}", n)[0])
    for page in ("/ui/", "/ui/?state=failed", "/ui/admin", "/ui/admin/live"):
        web = httpx.Client(base_url=args.url, timeout=120)
        assert web.post(
            "/ui/session", json={"key": args.admin_key}, headers={"X-Requested-With": "gpujobs"}
        ).is_success
        report(f"GET {page} (admin, web)", timed(web, "GET", page, n)[0])
    if args.prune_days is not None:
        body = {"older_than_s": args.prune_days * 86_400}
        took, pruned = timed(admin, "POST", "/admin/prune", 1, json=body)
        report(f"POST /admin/prune ({pruned['jobs']} jobs)", took)
        report("POST /admin/prune (nothing to do)", timed(admin, "POST", "/admin/prune", 3, json=body)[0])


if __name__ == "__main__":
    main()
