"""Build a database with months of history, to measure the service at scale (on demand, never by pytest).

    .venv/bin/python -m tests.bench.scale_db --server postgresql://postgres@localhost:5432
    .venv/bin/python -m tests.bench.scale_db --server postgresql://postgres@localhost:5432 --drop

It creates the database, migrates it with `gpujobs migrate`, and fills it in SQL: 300 owners with
API keys; 1,000,000 finished jobs over 180 days (90% succeeded, 6% failed, 3% canceled, 1%
quarantined; of six models), each with its events (submitted, claimed, started, its end, and
`expired` once retention took it), with a hole in the event ids about once a day; those older than
30 days expired, their inputs gone, as GPUJOBS_RETENTION_DAYS=30 leaves them; 200,000 inputs
kept; 20 workers running 50 jobs; 5,000 queued jobs of four models over six priorities and five
VRAM sizes, and 100 scheduled retries. Then VACUUM ANALYZE, and two keys printed: an admin's and
one of `owner-7`'s. About 80 s and 1.4 GB on the 2-core VM. tests/bench/scale_http.py times the
API on it; see tests/bench/README.md, "Scale".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import asyncpg

FILL = """
-- owners and keys
INSERT INTO api_keys (principal, prefix, key_hash, role, created_at)
SELECT 'owner-' || o, 'gpj_' || lpad(o::text, 4, '0'), md5('key' || o) || md5('k2' || o),
       CASE WHEN o <= 3 THEN 'admin' ELSE 'user' END, now() - interval '200 days'
FROM generate_series(1, 300) AS o;
-- inputs still kept: those of the jobs of the last 30 days, and of the waiting ones
INSERT INTO inputs (sha256, media_type, width, height, bytes, data, created_at)
SELECT md5('in' || i) || md5('in2' || i), 'image/png', 512, 512, 64, decode(repeat('ab', 64), 'hex'),
       now() - make_interval(secs => (200000 - i) * 13)
FROM generate_series(1, 200000) AS i;
-- 1,000,000 finished jobs over 180 days, oldest first
INSERT INTO jobs (owner, model, params, input_id, megapixels, priority, vram_mb, declared_vram_mb,
                  vram_peak_mb, state, attempt, max_attempts, run_after, worker_id, host, gpu,
                  progress, error, results, created_at, started_at, finished_at, expired_at,
                  cancel_requested, abnormal_runs)
SELECT 'owner-' || (1 + (g::bigint * 7919) % 300),
       (ARRAY['relief', 'relief', 'relief', 'triposr', 'depth', 'upscale'])[1 + g % 6],
       '{"format": "glb"}',
       CASE WHEN t.created_at > now() - interval '30 days' OR s.state = 'quarantined'
            THEN 1 + (g % 200000) END,
       0.26, (g % 3) - 1, 1500 + (g % 5) * 1000, 1500 + (g % 5) * 1000,
       CASE WHEN s.state = 'succeeded' THEN 1400 + (g % 5) * 1000 END,
       CAST(s.state AS job_state),
       CASE s.state WHEN 'canceled' THEN 0 WHEN 'succeeded' THEN 1 ELSE 3 END, 3,
       t.created_at, 'w' || (g % 20), 'host' || (g % 20), 0,
       CASE WHEN s.state = 'succeeded' THEN 1 ELSE 0 END,
       CASE WHEN s.state IN ('failed', 'quarantined') THEN 'model exited with code 1' END,
       CASE WHEN s.state = 'succeeded'
            THEN jsonb_build_array(jsonb_build_object('name', 'mesh.glb', 'bytes', 1000,
                                                      'sha256', repeat('a', 64),
                                                      'media_type', 'model/gltf-binary'))
            ELSE '[]'::jsonb END,
       t.created_at,
       CASE WHEN s.state <> 'canceled' THEN t.created_at + interval '5 seconds' END,
       t.created_at + interval '40 seconds',
       -- retention (30 days) took the files of the older ones; quarantined jobs wait for an admin
       CASE WHEN t.created_at <= now() - interval '30 days 1 hour' AND s.state <> 'quarantined'
            THEN t.created_at + interval '30 days 1 hour' END,
       s.state = 'canceled', CASE WHEN s.state = 'quarantined' THEN 3 ELSE 0 END
FROM generate_series(1, 1000000) AS g
CROSS JOIN LATERAL (
    SELECT now() - interval '1 hour' - make_interval(secs => (1000000 - g) * 15.552) AS created_at
) AS t
CROSS JOIN LATERAL (
    SELECT CASE WHEN g % 100 < 90 THEN 'succeeded' WHEN g % 100 < 96 THEN 'failed'
                WHEN g % 100 < 99 THEN 'canceled' ELSE 'quarantined' END AS state
) AS s
ORDER BY g;
-- their events, in time order, with a hole in the ids about once a day (a write rolled back, a
-- restart of the database)
INSERT INTO job_events (id, job_id, at, kind, attempt, worker_id, detail)
SELECT n + n / 26000, job_id, at, kind, attempt, worker, detail
FROM (
    SELECT row_number() OVER (ORDER BY e.at, j.id, e.step) AS n, j.id AS job_id, e.*
    FROM jobs AS j
    CROSS JOIN LATERAL (VALUES
        (1, j.created_at, 'submitted', 0, NULL,
         jsonb_build_object('model', j.model, 'priority', j.priority)),
        (2, j.created_at + interval '5 seconds',
         CASE WHEN j.state <> 'canceled' THEN 'claimed' END, 1, j.worker_id, '{"gpu": 0}'::jsonb),
        (3, j.created_at + interval '6 seconds',
         CASE WHEN j.state <> 'canceled' THEN 'started' END, 1, j.worker_id, '{"pid": 1}'::jsonb),
        (4, j.finished_at, CAST(j.state AS text), j.attempt, j.worker_id, '{}'::jsonb),
        (5, j.expired_at, CASE WHEN j.expired_at IS NOT NULL THEN 'expired' END, j.attempt, NULL,
         '{"by": "retention"}'::jsonb)
    ) AS e(step, at, kind, attempt, worker, detail)
    WHERE e.kind IS NOT NULL
) AS e
ORDER BY n;
SELECT setval(pg_get_serial_sequence('job_events', 'id'), (SELECT max(id) FROM job_events));
-- 20 workers
INSERT INTO workers (id, host, pid, state, models, gpus)
SELECT 'w' || w, 'host' || w, 1000 + w, 'running', '["relief", "triposr", "depth", "upscale"]',
       '[{"index": 0, "name": "virtual", "total_mb": 24000, "free_mb": 12000, "reserved_mb": 8000}]'
FROM generate_series(0, 19) AS w;
-- 50 running jobs
WITH r AS (
    INSERT INTO jobs (owner, model, input_id, megapixels, priority, vram_mb, declared_vram_mb,
                      state, attempt, max_attempts, worker_id, host, gpu, pid, lease_expires_at,
                      created_at, started_at, progress)
    SELECT 'owner-' || (1 + g % 300), (ARRAY['relief', 'triposr', 'depth', 'upscale'])[1 + g % 4],
           199000 + g, 0.26, 0, 2000, 2000, 'running', 1, 3, 'w' || (g % 20), 'host' || (g % 20),
           0, 5000 + g, now() + interval '1 day', now() - interval '2 minutes',
           now() - interval '1 minute', 0.5
    FROM generate_series(1, 50) AS g
    RETURNING id, created_at, worker_id
)
INSERT INTO job_events (job_id, at, kind, attempt, worker_id)
SELECT id, created_at, 'submitted', 0, NULL FROM r
UNION ALL
SELECT id, created_at + interval '1 minute', 'claimed', 1, worker_id FROM r;
-- 5,000 queued jobs (four models, six priorities, five sizes) and 100 scheduled retries
WITH q AS (
    INSERT INTO jobs (owner, model, input_id, megapixels, priority, vram_mb, declared_vram_mb,
                      state, attempt, max_attempts, created_at, run_after)
    SELECT 'owner-' || (1 + g % 300), (ARRAY['relief', 'relief', 'triposr', 'depth', 'upscale'])[1 + g % 5],
           190000 + g % 9000, 0.26, (ARRAY[-5, 0, 0, 0, 5, 10])[1 + g % 6],
           (ARRAY[1500, 2500, 6000, 12000, 30000])[1 + g % 5], 1500,
           CAST(CASE WHEN g > 5000 THEN 'scheduled' ELSE 'queued' END AS job_state),
           CASE WHEN g > 5000 THEN 1 ELSE 0 END, 3, now() - make_interval(secs => (5100 - g) * 0.5),
           CASE WHEN g > 5000 THEN now() + interval '10 minutes'
                ELSE now() - make_interval(secs => (5100 - g) * 0.5) END
    FROM generate_series(1, 5100) AS g
    RETURNING id, created_at
)
INSERT INTO job_events (job_id, at, kind, attempt) SELECT id, created_at, 'submitted', 0 FROM q;
"""


def gpujobs(url: str, *args: str) -> str:
    """Run the CLI on the database at `url`; its stdout."""
    env = {**os.environ, "GPUJOBS_DATABASE_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "app", *args], env=env, check=True, capture_output=True, text=True
    ).stdout


async def on_server(server: str, statement: str) -> None:
    """Run one statement on the server's `postgres` database (CREATE or DROP DATABASE)."""
    admin = await asyncpg.connect(f"{server}/postgres")
    try:
        await admin.execute(statement)
    finally:
        await admin.close()


async def build(server: str, name: str) -> str:
    """Create, migrate and fill the database; its URL."""
    await on_server(server, f'CREATE DATABASE "{name}"')
    url = f"{server}/{name}"
    gpujobs(url, "migrate")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SET synchronous_commit = off")
        for statement in filter(str.strip, FILL.split(";\n")):
            started = time.perf_counter()
            await conn.execute(statement)
            print(
                f"{time.perf_counter() - started:6.1f} s  {statement.strip().splitlines()[0]}",
                file=sys.stderr,
            )
        await conn.execute("VACUUM ANALYZE")
        for row in await conn.fetch(
            "SELECT state, count(*) AS jobs, count(expired_at) AS expired FROM jobs GROUP BY 1"
        ):
            print(f"{row['state']:<12} {row['jobs']:>8} jobs, {row['expired']:>7} expired")
        print(f"{await conn.fetchval('SELECT count(*) FROM job_events'):>8} events")
    finally:
        await conn.close()
    return url


async def drop(server: str, name: str) -> None:
    """Drop the database."""
    await on_server(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    """Build (or drop) the database."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", required=True, help="postgresql://user@host:port (no database)")
    parser.add_argument("--name", default="gpujobs_scale")
    parser.add_argument("--drop", action="store_true")
    args = parser.parse_args()
    if args.drop:
        asyncio.run(drop(args.server, args.name))
        return
    url = asyncio.run(build(args.server, args.name))
    for principal, flags in (("scale-admin", ["--admin"]), ("owner-7", [])):
        key = gpujobs(url, "keys", "create", principal, *flags).split()[0]
        print(f"key of {principal}: {key}")
    print(f"database: {url}")


if __name__ == "__main__":
    main()
