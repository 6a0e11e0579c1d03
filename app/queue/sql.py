"""Every statement of the queue, by name. Bind parameters only; each is one round trip.

Writes made on behalf of a run are fenced: `WHERE id = :id AND attempt = :attempt AND state = 'running'`.
A statement that matches no row means this attempt lost the job (lease expired, canceled, or a
newer attempt owns it); the manager raises `LeaseLost` and the caller discards its work.
"""

from __future__ import annotations

from sqlalchemy import text

QUEUED_CHANNEL = "gpujobs_queued"
CANCEL_CHANNEL = "gpujobs_cancel"

# -- intake -----------------------------------------------------------------------------------

# Is the queue full (at least :limit queued jobs)? Counts at most :limit rows.
QUEUE_FULL = text(
    """
    SELECT count(*) >= :limit FROM (
        SELECT 1 FROM jobs WHERE state = 'queued' LIMIT :limit
    ) AS q
    """
)

FIND_INPUT = text("SELECT id FROM inputs WHERE sha256 = :sha256")

# Insert an image once per content; on a concurrent duplicate, return the row that won.
INSERT_INPUT = text(
    """
    INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
    VALUES (:sha256, :media_type, :width, :height, :bytes, :data)
    ON CONFLICT (sha256) DO UPDATE SET sha256 = EXCLUDED.sha256
    RETURNING id
    """
)

FIND_IDEMPOTENT = text("SELECT * FROM jobs WHERE owner = :owner AND idempotency_key = :key")

# Queue a job, write its `submitted` event and wake the workers, in one statement.
# Returns no row when the idempotency key was taken by a concurrent request.
ENQUEUE = text(
    f"""
    WITH job AS (
        INSERT INTO jobs (owner, model, params, input_id, megapixels, priority, vram_mb,
                          max_attempts, idempotency_key)
        VALUES (:owner, :model, CAST(:params AS jsonb), :input_id, :megapixels, :priority,
                :vram_mb, :max_attempts, :idempotency_key)
        ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING *
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, detail)
        SELECT id, 'submitted', 0,
               jsonb_build_object('model', model, 'priority', priority, 'vram_mb', vram_mb)
        FROM job
    )
    SELECT job.* FROM job, LATERAL (SELECT pg_notify('{QUEUED_CHANNEL}', job.model)) AS wake
    """
)

# -- the claim --------------------------------------------------------------------------------

# Claim the best queued job that fits one of this worker's GPUs, and place it on the GPU that
# fits it most tightly. The candidate search probes the claim index once per (model, size class)
# and keeps the best head, so queued jobs that fit nowhere are never walked past one by one.
# `:gpu_ids` / `:gpu_budgets` are parallel arrays; `:budget` is their maximum.
CLAIM = text(
    """
    WITH candidate AS (
        SELECT head.id
        FROM unnest(CAST(:models AS text[])) AS m(model)
        CROSS JOIN unnest(CAST(:classes AS smallint[])) AS k(cls)
        CROSS JOIN LATERAL (
            SELECT j.id, j.priority, j.created_at
            FROM jobs AS j
            WHERE j.state = 'queued' AND j.model = m.model AND j.vram_class = k.cls
              AND j.vram_mb <= :budget AND j.run_after <= now()
            ORDER BY j.priority DESC, j.created_at
            LIMIT 1
            FOR UPDATE SKIP LOCKED
        ) AS head
        ORDER BY head.priority DESC, head.created_at
        LIMIT 1
    ), claimed AS (
        UPDATE jobs AS j
        SET state = 'running', attempt = j.attempt + 1, worker_id = :worker_id, host = :host,
            gpu = (SELECT g.id FROM unnest(CAST(:gpu_ids AS int[]), CAST(:gpu_budgets AS int[]))
                       AS g(id, budget)
                   WHERE g.budget >= j.vram_mb ORDER BY g.budget, g.id LIMIT 1),
            pid = NULL, progress = 0, progress_message = NULL,
            lease_expires_at = now() + make_interval(secs => :lease_s), started_at = now()
        FROM candidate
        WHERE j.id = candidate.id
        RETURNING j.*
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'claimed', attempt, worker_id, jsonb_build_object('gpu', gpu, 'vram_mb', vram_mb)
        FROM claimed
    )
    SELECT * FROM claimed
    """
)

# -- a run's fenced writes --------------------------------------------------------------------

# The model process started: record its pid and host (restart recovery kills leftovers by them).
SET_PID = text(
    """
    WITH started AS (
        UPDATE jobs SET pid = :pid
        WHERE id = :id AND attempt = :attempt AND state = 'running'
        RETURNING id, attempt, worker_id, gpu, host, pid, cancel_requested
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'started', attempt, worker_id,
               jsonb_build_object('pid', pid, 'gpu', gpu, 'host', host)
        FROM started
    )
    SELECT cancel_requested FROM started
    """
)

PROGRESS = text(
    """
    UPDATE jobs SET progress = :progress, progress_message = :message
    WHERE id = :id AND attempt = :attempt AND state = 'running'
    RETURNING cancel_requested
    """
)

# An event for this attempt, written only while the attempt still owns the job.
RUN_EVENT = text(
    """
    INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
    SELECT id, CAST(:kind AS text), attempt, worker_id, CAST(:detail AS jsonb)
    FROM jobs WHERE id = :id AND attempt = :attempt AND state = 'running'
    RETURNING id
    """
)

SUCCEED = text(
    """
    WITH done AS (
        UPDATE jobs
        SET state = 'succeeded', progress = 1, results = CAST(:results AS jsonb), error = NULL,
            finished_at = now(), lease_expires_at = NULL
        WHERE id = :id AND attempt = :attempt AND state = 'running'
        RETURNING id, attempt, worker_id
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'succeeded', attempt, worker_id, CAST(:detail AS jsonb) FROM done
    )
    SELECT id FROM done
    """
)

# A run that did not succeed: canceled if a cancel was asked for, queued again after
# `:delay_s` while attempts remain and the failure is retryable, failed otherwise.
FAIL = text(
    f"""
    WITH ended AS (
        UPDATE jobs
        SET state = CAST(CASE
                WHEN cancel_requested THEN 'canceled'
                WHEN :retryable AND attempt < max_attempts THEN 'queued'
                ELSE 'failed' END AS job_state),
            error = :error, lease_expires_at = NULL, pid = NULL,
            run_after = now() + make_interval(secs => :delay_s),
            finished_at = CASE WHEN cancel_requested OR NOT (:retryable AND attempt < max_attempts)
                          THEN now() END
        WHERE id = :id AND attempt = :attempt AND state = 'running'
        RETURNING id, attempt, worker_id, state, run_after, model
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CASE state WHEN 'queued' THEN 'retry_scheduled' ELSE state::text END,
               attempt, worker_id,
               CAST(:detail AS jsonb) || jsonb_build_object('run_after', run_after)
        FROM ended
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM ended WHERE state = 'queued'
    )
    SELECT ended.state, ended.run_after, (SELECT count(*) FROM wake) AS woken FROM ended
    """
)

# Graceful shutdown: hand a running job back without spending an attempt. `attempt` must only
# grow (fencing), so the attempt budget grows by one instead.
RELEASE = text(
    f"""
    WITH released AS (
        UPDATE jobs
        SET state = 'queued', max_attempts = max_attempts + 1, run_after = now(),
            lease_expires_at = NULL, pid = NULL, progress = 0, progress_message = NULL
        WHERE id = :id AND attempt = :attempt AND state = 'running' AND NOT cancel_requested
        RETURNING id, attempt, worker_id, model
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'released', attempt, worker_id, jsonb_build_object('reason', CAST(:reason AS text))
        FROM released
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM released
    )
    SELECT id, (SELECT count(*) FROM wake) AS woken FROM released
    """
)

RUNNING_ATTEMPTS = text("SELECT id, attempt FROM jobs WHERE state = 'running'")

# -- leases -----------------------------------------------------------------------------------

# Renew the leases of the jobs this worker is running (`:ids`) and its own heartbeat; returns
# those it still owns. A job whose attempt died inside the worker is left to expire.
HEARTBEAT = text(
    """
    WITH renewed AS (
        UPDATE jobs SET lease_expires_at = now() + make_interval(secs => :lease_s)
        WHERE worker_id = :worker_id AND state = 'running' AND id = ANY(CAST(:ids AS uuid[]))
        RETURNING id, attempt, cancel_requested
    ), me AS (
        UPDATE workers SET heartbeat_at = now(), gpus = CAST(:gpus AS jsonb), state = :state
        WHERE id = :worker_id
    )
    SELECT id, attempt, cancel_requested FROM renewed
    """
)

# Take back running jobs (those matched by {where}) from a worker that is gone: queue them again,
# or fail them when their attempts are used up, or cancel them if a cancel was asked for.
_TAKE_BACK = """
    WITH lost AS (
        SELECT id FROM jobs WHERE state = 'running' AND {where}
        ORDER BY lease_expires_at LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), back AS (
        UPDATE jobs AS j
        SET state = CAST(CASE
                WHEN j.cancel_requested THEN 'canceled'
                WHEN j.attempt >= j.max_attempts THEN 'failed'
                ELSE 'queued' END AS job_state),
            error = CAST(:reason AS text) || ' (worker ' || coalesce(j.worker_id, '?') || ', attempt '
                    || j.attempt || ')',
            lease_expires_at = NULL, run_after = now(),
            finished_at = CASE WHEN j.cancel_requested OR j.attempt >= j.max_attempts
                          THEN now() END
        FROM lost WHERE j.id = lost.id
        RETURNING j.id, j.attempt, j.worker_id, j.state, j.pid, j.host, j.model
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CASE state WHEN 'queued' THEN 'recovered' ELSE state::text END, attempt,
               CAST(:by_worker AS text),
               jsonb_build_object('lost_worker', worker_id, 'reason', CAST(:reason AS text),
                                  'state', state)
        FROM back
    ), wake AS (
        SELECT pg_notify('{channel}', model) FROM back WHERE state = 'queued'
    )
    SELECT id, attempt, worker_id, state, pid, host, (SELECT count(*) FROM wake) AS woken FROM back
"""

# Expired leases, except the jobs the calling worker is running right now: after a database
# outage their leases may have lapsed, but their worker is alive and will renew or finish them.
RECOVER_EXPIRED = text(
    _TAKE_BACK.format(
        where="lease_expires_at < now() AND NOT (id = ANY(CAST(:in_hand AS uuid[])))", channel=QUEUED_CHANNEL
    )
)

# On start: this worker's own running jobs belong to its previous life; no need to wait.
REQUEUE_OWN = text(_TAKE_BACK.format(where="worker_id = :worker_id", channel=QUEUED_CHANNEL))

# Running jobs with a model process on this host that is about to be taken back: killed first,
# so the old run is gone before a new attempt can start.
LEFTOVERS_ON_HOST = text(
    """
    SELECT id, attempt, worker_id, state, pid, host FROM jobs
    WHERE state = 'running' AND host = :host AND pid IS NOT NULL
      AND (lease_expires_at < now() OR worker_id = CAST(:worker_id AS text))
    """
)

MARK_DEAD_WORKERS = text(
    """
    UPDATE workers SET state = 'dead'
    WHERE state IN ('running', 'stopping')
      AND heartbeat_at < now() - make_interval(secs => :dead_after_s)
    RETURNING id
    """
)

REGISTER_WORKER = text(
    """
    INSERT INTO workers (id, host, pid, state, models, gpus)
    VALUES (:id, :host, :pid, 'running', CAST(:models AS jsonb), CAST(:gpus AS jsonb))
    ON CONFLICT (id) DO UPDATE
    SET host = EXCLUDED.host, pid = EXCLUDED.pid, state = 'running', started_at = now(),
        heartbeat_at = now(), models = EXCLUDED.models, gpus = EXCLUDED.gpus
    """
)

SET_WORKER_STATE = text("UPDATE workers SET state = :state, heartbeat_at = now() WHERE id = :id")

# -- user and admin actions -------------------------------------------------------------------

# A queued job is canceled at once; a running one is flagged and its worker told to kill it.
CANCEL = text(
    f"""
    WITH target AS (
        SELECT id, state AS old_state FROM jobs
        WHERE id = :id AND (CAST(:owner AS text) IS NULL OR owner = :owner)
          AND state IN ('queued', 'running')
        FOR UPDATE
    ), changed AS (
        UPDATE jobs AS j
        SET cancel_requested = true,
            state = CAST(CASE WHEN target.old_state = 'queued' THEN 'canceled'
                         ELSE j.state::text END AS job_state),
            finished_at = CASE WHEN target.old_state = 'queued' THEN now() END
        FROM target WHERE j.id = target.id
        RETURNING j.id, j.state, j.attempt, j.worker_id
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CASE state WHEN 'canceled' THEN 'canceled' ELSE 'cancel_requested' END,
               attempt, worker_id, jsonb_build_object('by', CAST(:by AS text))
        FROM changed
    ), wake AS (
        SELECT pg_notify('{CANCEL_CHANNEL}', id::text) FROM changed WHERE state = 'running'
    )
    SELECT changed.state, (SELECT count(*) FROM wake) AS woken FROM changed
    """
)

# Admin retry: a failed or canceled job is queued again with a fresh budget of attempts.
# `attempt` keeps counting (fencing needs it to only grow); `max_attempts` moves up instead.
_RETRY = f"""
    WITH retried AS (
        UPDATE jobs
        SET state = 'queued', max_attempts = attempt + :attempts, run_after = now(),
            error = NULL, cancel_requested = false, finished_at = NULL, progress = 0,
            progress_message = NULL, results = '[]'::jsonb, lease_expires_at = NULL, pid = NULL
        WHERE state IN ('failed', 'canceled') AND {{where}}
        RETURNING id, attempt, model
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, detail)
        SELECT id, 'retried', attempt, jsonb_build_object('by', CAST(:by AS text)) FROM retried
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM (SELECT DISTINCT model FROM retried) AS m
    )
    SELECT id, (SELECT count(*) FROM wake) AS woken FROM retried
"""

RETRY_ONE = text(_RETRY.format(where="id = :id"))

RETRY_MATCHING = text(
    _RETRY.format(
        where="""state = 'failed'
          AND (CAST(:model AS text) IS NULL OR model = :model)
          AND (CAST(:error_contains AS text) IS NULL
               OR strpos(coalesce(error, ''), :error_contains) > 0)
          AND (CAST(:since AS timestamptz) IS NULL OR finished_at >= :since)
          AND (CAST(:until AS timestamptz) IS NULL OR finished_at < :until)"""
    )
)

JOB_STATE = text("SELECT state FROM jobs WHERE id = :id AND (CAST(:owner AS text) IS NULL OR owner = :owner)")

EVENTS = text(
    """
    SELECT e.id, e.at, e.kind, e.attempt, e.worker_id, e.detail
    FROM job_events AS e JOIN jobs AS j ON j.id = e.job_id
    WHERE e.job_id = :id AND (CAST(:owner AS text) IS NULL OR j.owner = :owner)
    ORDER BY e.id
    """
)
