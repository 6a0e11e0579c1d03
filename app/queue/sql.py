"""Every statement of the queue, by name. Bind parameters only; each is one round trip.

Writes made on behalf of a run are fenced: `WHERE id = :id AND attempt = :attempt AND state = 'running'`.
A statement that matches no row means this attempt lost the job (lease expired, canceled, or a
newer attempt owns it); the manager raises `LeaseLost` and the caller discards its work.
"""

from __future__ import annotations

from sqlalchemy import text

QUEUED_CHANNEL = "gpujobs_queued"
CANCEL_CHANNEL = "gpujobs_cancel"
# A job's state or progress changed (the SSE streams listen): {job, state, attempt, progress, event, kind}.
JOB_CHANNEL = "gpujobs_job"


def _tell(jobs: str, event: str | None = "event", *, message: bool = False) -> str:
    """SQL: NOTIFY JOB_CHANNEL of each changed row of `jobs` and the `event` row written for it."""
    source = f"{event} AS e JOIN {jobs} AS c ON c.id = e.job_id" if event else f"{jobs} AS c"
    ids = "e.id, 'kind', e.kind" if event else "NULL, 'kind', NULL"
    note = ", 'message', c.progress_message" if message else ""
    return f"""
        SELECT pg_notify('{JOB_CHANNEL}', json_build_object(
            'job', c.id, 'state', c.state, 'attempt', c.attempt, 'progress', c.progress,
            'event', {ids}{note})::text)
        FROM {source}"""


# -- intake -----------------------------------------------------------------------------------

# The job of this owner with this idempotency key: one that lost a race re-reads it, and a repeat
# refused now (its model gone, its params checked more strictly since) looks for it.
FIND_IDEMPOTENT = text("SELECT * FROM jobs WHERE owner = :owner AND idempotency_key = :key")

# The jobs waiting (queued or scheduled), each state counted up to :queue_limit: a scan of that many
# index entries at most, however long the queue.
_WAITING = """
            (SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'queued' LIMIT :queue_limit) AS q)
          + (SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'scheduled' LIMIT :queue_limit) AS s)"""
# The owner's jobs waiting, each state counted up to :owner_limit, likewise.
_OWNER_WAITING = """
            (SELECT count(*) FROM (SELECT 1 FROM jobs WHERE owner = :owner AND state = 'queued'
                                   LIMIT :owner_limit) AS oq)
          + (SELECT count(*) FROM (SELECT 1 FROM jobs WHERE owner = :owner AND state = 'scheduled'
                                   LIMIT :owner_limit) AS os)"""

# How full the queue is, counted as ENQUEUE counts it, for an upload refused before its body while
# the API remembers the queue or the owner's share full (app/api/fullness.py): with :count_all the
# jobs waiting, with :count_owner the owner's; a count not asked for is NULL and costs nothing.
ROOM = text(
    """
    SELECT CASE WHEN CAST(:count_all AS boolean) THEN"""
    + _WAITING
    + """
           END AS waiting,
           CASE WHEN CAST(:count_owner AS boolean) THEN"""
    + _OWNER_WAITING
    + """
           END AS owner_waiting
    """
)

# Queue a job, in one statement (run in autocommit: no BEGIN / COMMIT round trips). In order:
# - `prior`: the owner's job with this idempotency key: it comes back, nothing is written;
# - `counted`: with :count_waiting, the jobs waiting, up to :queue_limit. Queued and scheduled jobs
#   are counted apart, each on its partial index: `state IN (...)` took a scan of the whole table,
#   finished jobs included (15 ms per upload beside 200,000 of them). Even so the count reads one
#   index entry per job waiting (1.6 ms beside 9,900 queued), so the caller asks for it only when
#   the queue may be near its limit (JobManager.enqueue);
# - `verdict`: else 'owner_full' when the owner has :owner_limit jobs waiting (0: no limit), else
#   'queue_full' when the count reached :queue_limit; nothing is written;
# - else 'queued': the image is stored once per content (`found` by sha256, else inserted; on a
#   concurrent duplicate the row that won comes back), the job, its `submitted` event (its NOTIFYs
#   follow the commit: TELL).
#   `found` locks the row it finds (FOR KEY SHARE, as the job's foreign key check would, later):
#   retention deletes an image whose last job expired, and could do so between this read and the
#   job's insert, which then failed on the foreign key. Retention locks the rows it may delete
#   first (LOCK_INPUTS); whichever comes second waits for the other's end. Retention then sees the
#   new job and keeps the image, or this read skips the deleted row and the image is stored again.
# Returns one row: `outcome`, `jobs_waiting` (the count, or NULL), `submitted_event` (the event's id,
# or NULL), `stored_input` (the image's id when this statement stored it), then the job's columns
# (NULL when full, or when a concurrent request took the idempotency key first: the caller then
# reads that job with FIND_IDEMPOTENT, and removes the image it stored for nothing: DROP_UNUSED_INPUT).
ENQUEUE = text(
    """
    WITH prior AS (
        SELECT * FROM jobs WHERE owner = :owner AND idempotency_key = CAST(:idempotency_key AS text)
    ), counted AS (
        -- Jobs waiting, up to the limit: a scan of that many index entries, so only when asked.
        SELECT CASE WHEN CAST(:count_waiting AS boolean) THEN
"""
    + _WAITING
    + """
        END AS waiting
    ), verdict AS (
        SELECT CASE
            -- The key the upload came with, revoked while its body arrived (minutes, for a large
            -- image on a slow link): nothing is written for it.
            WHEN CAST(:key_id AS bigint) IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM api_keys WHERE id = CAST(:key_id AS bigint) AND revoked_at IS NULL
            ) THEN 'revoked'
            WHEN EXISTS (SELECT 1 FROM prior) THEN 'repeat'
            WHEN :owner_limit > 0 AND"""
    + _OWNER_WAITING
    + """ >= :owner_limit THEN 'owner_full'
            WHEN (SELECT waiting FROM counted) >= :queue_limit THEN 'queue_full'
            ELSE 'queued'
        END AS outcome, (SELECT waiting FROM counted) AS waiting
    ), found AS (
        SELECT id FROM inputs WHERE sha256 = :sha256 FOR KEY SHARE
    ), stored AS (
        INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
        SELECT :sha256, :media_type, CAST(:width AS integer), CAST(:height AS integer),
               CAST(:bytes AS bigint), CAST(:data AS bytea)
        FROM verdict WHERE outcome = 'queued' AND NOT EXISTS (SELECT 1 FROM found)
        ON CONFLICT (sha256) DO UPDATE SET sha256 = EXCLUDED.sha256
        RETURNING id
    ), job AS (
        INSERT INTO jobs (owner, model, params, input_id, megapixels, priority, vram_mb,
                          declared_vram_mb, max_attempts, idempotency_key, request_sha256)
        SELECT :owner, :model, CAST(:params AS jsonb), i.id, CAST(:megapixels AS real),
               CAST(:priority AS integer), CAST(:vram_mb AS integer),
               CAST(:declared_vram_mb AS integer), CAST(:max_attempts AS integer),
               CAST(:idempotency_key AS text), CAST(:request_sha256 AS text)
        FROM verdict, (SELECT id FROM found UNION ALL SELECT id FROM stored) AS i
        WHERE verdict.outcome = 'queued'
        ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING *
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, detail)
        SELECT id, 'submitted', 0,
               jsonb_build_object('model', model, 'priority', priority, 'vram_mb', vram_mb,
                                  'declared_vram_mb', declared_vram_mb)
        FROM job
        RETURNING id, job_id, kind
    )
    SELECT verdict.outcome, verdict.waiting AS jobs_waiting, (SELECT id FROM event) AS submitted_event,
           (SELECT id FROM stored) AS stored_input, j.*
    FROM verdict LEFT JOIN (SELECT * FROM job UNION ALL SELECT * FROM prior) AS j ON true
    """
)

# An image stored by an upload whose job was not made after all (it lost its idempotency key to a
# concurrent upload), unless a job uses it by now: an upload of the same image that found it meanwhile
# (and locked it FOR KEY SHARE, which this waits for). One whose job committed after this statement's
# snapshot fails the foreign key check instead, and the caller lets the image be.
DROP_UNUSED_INPUT = text(
    "DELETE FROM inputs AS i WHERE id = :id AND NOT EXISTS (SELECT FROM jobs WHERE input_id = i.id)"
)

# NOTIFYs sent apart from the statements they tell of, after those commit (JobManager.teller):
# many in one statement, whose commit does not wait for the disk (`synchronous_commit` off for
# this transaction alone, which writes nothing else). PostgreSQL serializes the commits of every
# transaction that notifies, under one lock held until the commit is on disk (async.c,
# PreCommit_Notify): with its NOTIFYs inside, each upload's commit, a megabyte of image to flush,
# took its turn behind the others', and waited behind any other notifier stuck in its commit.
# Lost in a crash, they cost a wait of at most GPUJOBS_POLL_INTERVAL_S (workers poll) and nothing
# else (a job's stream reads the database first).
TELL = text(
    """
    SELECT set_config('synchronous_commit', 'off', true) AS commit,
           (SELECT count(pg_notify(c, p))
            FROM unnest(CAST(:channels AS text[]), CAST(:payloads AS text[])) AS n(c, p)) AS sent
    """
)

# -- the claim --------------------------------------------------------------------------------

# Claim up to :limit of the best queued jobs that fit this worker's GPUs, each placed on the GPU
# that fits it most tightly, in one statement; the input images come back with them (no second
# round trip). "Best" is the highest effective priority (priority + age_boost), then among equals
# a job whose model has a warm runner on one of these GPUs with room for it (`:warm_mb`, parallel to
# `:models`: the largest budget among the GPUs where the model is warm, 0 if none; `:warm_pairs`,
# "model:gpu", places it on such a GPU), then the oldest.
# The candidate search probes the claim index once per (model, size class) and takes at most
# :limit heads from each, so queued jobs that fit nowhere are never walked past one by one. Only
# the classes from a model's smallest queued one to its largest that fits (`:max_class`, of the
# largest budget) are probed, found by two more probes: all classes up to the budget were 97 per
# model on a 1 TiB GPU, 67 on 80 GB, nearly all of them empty, and probing them was about a third
# of the server's CPU per job (tests/bench/README.md, eleventh round). The
# candidates are then placed in order (`placed`, a greedy walk): each takes the tightest GPU with
# enough MB and a free slot left by those placed before it (a GPU with a slot free now before one
# whose slots left are claimed ahead, `:gpu_waits` of them, to wait for a running job's end), or is
# skipped (left queued). `:gpu_ids` / `:gpu_budgets` / `:gpu_slots` / `:gpu_waits` are parallel
# arrays; `:budget` is the largest budget.
# `:max_megapixels` (parallel to `:models`) and `:min_priority` narrow the claim for backfill and
# reservations. The placed rows are updated through their ids as an array (`id = ANY(ARRAY(...))`,
# read by primary key): joined to `placed` alone, whose size the planner guesses at hundreds of
# rows, the update read the whole `jobs` table, finished jobs and all, on every claim.
_CLAIM_STEPS = f"""
    candidate AS MATERIALIZED (
        SELECT head.id, head.model, head.vram_mb,
               row_number() OVER (ORDER BY head.effective DESC, head.vram_mb <= m.warm_mb DESC,
                                           head.created_at) AS rank
        FROM unnest(CAST(:models AS text[]), CAST(:max_megapixels AS real[]), CAST(:warm_mb AS int[]))
             AS m(model, max_mp, warm_mb)
        CROSS JOIN LATERAL (
            SELECT (SELECT q.vram_class FROM jobs AS q
                    WHERE q.state = 'queued' AND q.model = m.model
                    ORDER BY q.vram_class LIMIT 1) AS lo,
                   (SELECT q.vram_class FROM jobs AS q
                    WHERE q.state = 'queued' AND q.model = m.model AND q.vram_class <= :max_class
                    ORDER BY q.vram_class DESC LIMIT 1) AS hi
        ) AS span
        CROSS JOIN generate_series(CAST(span.lo AS int), CAST(span.hi AS int)) AS k(cls)
        CROSS JOIN LATERAL (
            SELECT j.id, j.model, j.vram_mb, j.priority + j.age_boost AS effective, j.created_at
            FROM jobs AS j
            WHERE j.state = 'queued' AND j.model = m.model AND j.vram_class = k.cls
              AND j.vram_mb <= :budget AND j.megapixels <= m.max_mp
              AND j.priority + j.age_boost >= :min_priority
            ORDER BY j.priority + j.age_boost DESC, j.created_at
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        ) AS head
    ), placed (rank, id, slot, budgets, slots, taken) AS (
        SELECT CAST(0 AS bigint), CAST(NULL AS uuid), CAST(NULL AS int),
               CAST(:gpu_budgets AS int[]), CAST(:gpu_slots AS int[]), 0
      UNION ALL
        SELECT c.rank, c.id, pick.slot,
               CASE WHEN pick.slot IS NULL THEN p.budgets ELSE array(
                   SELECT p.budgets[i] - CASE WHEN i = pick.slot THEN c.vram_mb ELSE 0 END
                   FROM generate_subscripts(p.budgets, 1) AS i ORDER BY i) END,
               CASE WHEN pick.slot IS NULL THEN p.slots ELSE array(
                   SELECT p.slots[i] - CASE WHEN i = pick.slot THEN 1 ELSE 0 END
                   FROM generate_subscripts(p.slots, 1) AS i ORDER BY i) END,
               p.taken + CASE WHEN pick.slot IS NULL THEN 0 ELSE 1 END
        FROM placed AS p
        JOIN candidate AS c ON c.rank = p.rank + 1
        CROSS JOIN LATERAL (
            SELECT (SELECT i FROM generate_subscripts(p.budgets, 1) AS i
                    WHERE p.budgets[i] >= c.vram_mb AND p.slots[i] > 0
                    ORDER BY (c.model || ':' || (CAST(:gpu_ids AS int[]))[i])
                                 = ANY(CAST(:warm_pairs AS text[])) DESC,
                             p.slots[i] > (CAST(:gpu_waits AS int[]))[i] DESC,
                             p.budgets[i], i
                    LIMIT 1) AS slot
            OFFSET 0  -- computed once per row: without it the planner copies the subquery to each use
        ) AS pick
        WHERE p.taken < :limit
    ), claimed AS (
        UPDATE jobs AS j
        SET state = 'running', attempt = j.attempt + 1, worker_id = :worker_id, host = :host,
            gpu = (CAST(:gpu_ids AS int[]))[placed.slot],
            pid = NULL, progress = 0, progress_message = NULL,
            lease_expires_at = now() + make_interval(secs => :lease_s), started_at = now()
        FROM placed
        WHERE j.id = ANY(ARRAY(SELECT id FROM placed WHERE slot IS NOT NULL)) AND j.id = placed.id
        RETURNING j.*, placed.rank
    ), claim_event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'claimed', attempt, worker_id, jsonb_build_object('gpu', gpu, 'vram_mb', vram_mb)
        FROM claimed
        RETURNING id, job_id, kind
    ), claim_told AS ({_tell("claimed", "claim_event")}
    )"""

# The claimed rows with their input images (told: their NOTIFYs are sent when this is read).
_CLAIMED_ROWS = """
    SELECT claimed.*, i.media_type AS input_media_type, i.data AS input_data
    FROM claimed LEFT JOIN inputs AS i ON i.id = claimed.input_id
    WHERE (SELECT count(*) FROM claim_told) >= 0"""

CLAIM = text(f"WITH RECURSIVE {_CLAIM_STEPS}{_CLAIMED_ROWS}\n    ORDER BY claimed.rank")

# -- a run's fenced writes --------------------------------------------------------------------

# The model process started: record its pid and host (restart recovery kills leftovers by them).
SET_PID = text(
    f"""
    WITH started AS (
        UPDATE jobs SET pid = :pid
        WHERE id = :id AND attempt = :attempt AND state = 'running'
        RETURNING id, attempt, worker_id, gpu, host, pid, cancel_requested, state, progress
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'started', attempt, worker_id,
               jsonb_build_object('pid', pid, 'gpu', gpu, 'host', host)
        FROM started
        RETURNING id, job_id, kind
    ), told AS ({_tell("started")}
    )
    SELECT cancel_requested, (SELECT count(*) FROM told) AS told FROM started
    """
)

PROGRESS = text(
    f"""
    WITH moved AS (
        UPDATE jobs SET progress = :progress, progress_message = :message
        WHERE id = :id AND attempt = :attempt AND state = 'running'
        RETURNING id, state, attempt, progress, progress_message, cancel_requested
    ), told AS ({_tell("moved", None, message=True)}
    )
    SELECT cancel_requested, (SELECT count(*) FROM told) AS told FROM moved
    """
)

# An event for this attempt, written only while the attempt still owns the job. The job's row is
# locked first (FOR SHARE waits for any update of it, and holds off the next one), so the event's
# id is taken in the order the job's changes commit, as every other event's is (each is written by
# the statement that updates the row): a cancel that took the next id and committed first had a
# stream skip this event as one already seen.
RUN_EVENT = text(
    f"""
    WITH event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CAST(:kind AS text), attempt, worker_id, CAST(:detail AS jsonb)
        FROM jobs WHERE id = :id AND attempt = :attempt AND state = 'running'
        FOR SHARE
        RETURNING id, job_id, kind
    ), told AS ({_tell("jobs")}
    )
    SELECT id, (SELECT count(*) FROM told) AS told FROM event
    """
)

# Several attempts' successes at once (parallel arrays; `:results` and `:details` hold JSON text),
# each fenced on its own; the ids that were still owned come back. The rows are read by key
# (`j.id = ANY(:ids)`): joined to the unnest alone, whose size the generic plan guesses at 100, the
# update read every running job through ix_jobs_worker (1,008 rows, 0.26 ms, for one success
# beside 1,000 running jobs), fleet-wide, on every finish. They are locked first, in id order, as
# HEARTBEAT locks its rows (updated in the order of `:ids`, the two statements deadlocked).
_SUCCEED_STEPS = f"""
    finished AS (
        SELECT *
        FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]), CAST(:results AS text[]),
                    CAST(:details AS text[])) AS f(id, attempt, results, detail)
    ), held AS (
        SELECT id FROM jobs
        WHERE id = ANY(CAST(:ids AS uuid[])) AND state = 'running'
        ORDER BY id
        FOR NO KEY UPDATE
    ), done AS (
        UPDATE jobs AS j
        SET state = 'succeeded', progress = 1, results = CAST(f.results AS jsonb), error = NULL,
            finished_at = now(), lease_expires_at = NULL
        FROM finished AS f
        WHERE j.id = ANY(ARRAY(SELECT id FROM held)) AND j.id = f.id AND j.attempt = f.attempt
          AND j.state = 'running'
        RETURNING j.id, j.attempt, j.worker_id, j.state, j.progress, CAST(f.detail AS jsonb) AS detail
    ), done_event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'succeeded', attempt, worker_id, detail FROM done
        RETURNING id, job_id, kind
    ), done_told AS ({_tell("done", "done_event")}
    )"""

SUCCEED = text(f"WITH {_SUCCEED_STEPS}\n    SELECT id, (SELECT count(*) FROM done_told) AS told FROM done")

# A worker's successes and its next claim in one statement: SUCCEED's parameters and CLAIM's, one
# transaction (each half fenced as it is alone; they touch different rows: running jobs end,
# queued jobs start). Every statement costs the server a fixed part (about 0.25 ms of CPU in the
# eleventh round's probe) beside its rows, and a worker under load ends jobs and fills their slots
# in the same moments. One row at least: `succeeded` (the ids still owned) on each, then the
# claimed jobs as CLAIM returns them, or NULLs when none was claimed. (Each NOTIFY step is read in a
# WHERE: a column no one selects is dropped from the plan, and its step with it.)
SUCCEED_AND_CLAIM = text(
    f"""
    WITH RECURSIVE {_SUCCEED_STEPS}, {_CLAIM_STEPS}
    SELECT s.succeeded, c.*
    FROM (SELECT array(SELECT id FROM done) AS succeeded WHERE (SELECT count(*) FROM done_told) >= 0) AS s
    LEFT JOIN ({_CLAIMED_ROWS}) AS c ON true
    ORDER BY c.rank
    """
)

# A run that did not succeed: canceled if a cancel was asked for, scheduled to run again after
# `:delay_s` (queued at once when 0) while attempts remain and the failure is retryable, failed
# otherwise. Scheduled jobs stay out of the claim index until PROMOTE_DUE queues them.
FAIL = text(
    f"""
    WITH decided AS (
        SELECT id, CAST(CASE
                WHEN cancel_requested THEN 'canceled'
                WHEN :abnormal AND abnormal_runs + 1 >= :quarantine_after THEN 'quarantined'
                WHEN :retryable AND attempt < max_attempts
                     AND CAST(:delay_s AS double precision) > 0 THEN 'scheduled'
                WHEN :retryable AND attempt < max_attempts THEN 'queued'
                ELSE 'failed' END AS job_state) AS next
        FROM jobs WHERE id = :id AND attempt = :attempt AND state = 'running'
        FOR UPDATE
    ), ended AS (
        UPDATE jobs AS j
        SET state = decided.next, error = :error, lease_expires_at = NULL, pid = NULL,
            abnormal_runs = j.abnormal_runs + CASE WHEN :abnormal THEN 1 ELSE 0 END,
            -- moved only on the way back to a wait: a job that ended in its run started after it
            run_after = CASE WHEN decided.next IN ('queued', 'scheduled')
                THEN now() + make_interval(secs => CAST(:delay_s AS double precision)) ELSE j.run_after END,
            finished_at = CASE WHEN decided.next IN ('queued', 'scheduled') THEN NULL ELSE now() END
        FROM decided WHERE j.id = decided.id
        RETURNING j.id, j.attempt, j.worker_id, j.state, j.run_after, j.model, j.progress
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CASE WHEN state IN ('queued', 'scheduled') THEN 'retry_scheduled'
                        ELSE state::text END,
               attempt, worker_id,
               CAST(:detail AS jsonb) || CASE WHEN state IN ('queued', 'scheduled')
                   THEN jsonb_build_object('run_after', run_after) ELSE '{{}}' END
        FROM ended
        RETURNING id, job_id, kind
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM ended WHERE state = 'queued'
    ), told AS ({_tell("ended")}
    )
    SELECT ended.state, ended.run_after, (SELECT count(*) FROM wake) AS woken,
           (SELECT count(*) FROM told) AS told
    FROM ended
    """
)


def _released(detail: str) -> str:
    """The CTEs after `released` (a job handed back to the queue, no attempt spent): its `released`
    event with `detail`, the workers woken, the streams told. Appended after `released`'s `)`."""
    return f""", event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'released', attempt, worker_id, {detail}
        FROM released
        RETURNING id, job_id, kind
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM released
    ), told AS ({_tell("released")}
    )"""


# Graceful shutdown: hand a running job back without spending an attempt. `attempt` must only
# grow (fencing), so the attempt budget grows by one instead.
RELEASE = text(
    f"""
    WITH released AS (
        UPDATE jobs
        SET state = 'queued', max_attempts = max_attempts + 1, run_after = now(),
            lease_expires_at = NULL, pid = NULL, progress = 0, progress_message = NULL
        WHERE id = :id AND attempt = :attempt AND state = 'running' AND NOT cancel_requested
        RETURNING id, attempt, worker_id, model, state, progress
    ){_released("jsonb_build_object('reason', CAST(:reason AS text))")}
    SELECT id, (SELECT count(*) FROM wake) AS woken, (SELECT count(*) FROM told) AS told FROM released
    """
)

# Files of a run this host could not write (a full disk, a folder gone read-only): the host's trouble,
# not the job's. The job goes back to the queue as RELEASE hands a job back, no attempt spent, its
# error saying why, unless it went back so `:most` times already (its `released` events with this
# `:reason`): then `released` is false and nothing is written (its attempt is failed instead).
# Fenced, and refused while a cancel is pending, as RELEASE: no row then.
RELEASE_STORAGE = text(
    f"""
    WITH mine AS (
        SELECT j.id, (SELECT count(*) FROM job_events AS e
                      WHERE e.job_id = j.id AND e.kind = 'released'
                        AND e.detail ->> 'reason' = CAST(:reason AS text)) AS times
        FROM jobs AS j
        WHERE j.id = :id AND j.attempt = :attempt AND j.state = 'running' AND NOT j.cancel_requested
        FOR UPDATE OF j
    ), released AS (
        UPDATE jobs AS j
        SET state = 'queued', max_attempts = j.max_attempts + 1, run_after = now(), error = :error,
            lease_expires_at = NULL, pid = NULL, progress = 0, progress_message = NULL
        FROM mine WHERE j.id = mine.id AND mine.times < :most
        RETURNING j.id, j.attempt, j.worker_id, j.model, j.state, j.progress
    ){_released("jsonb_build_object('reason', CAST(:reason AS text), 'error', CAST(:first_line AS text))")}
    SELECT id, EXISTS (SELECT FROM released) AS released, (SELECT count(*) FROM wake) AS woken,
           (SELECT count(*) FROM told) AS told
    FROM mine
    """
)


def _hand_back(held: str, *, also: str = "") -> str:
    """A statement that hands the jobs {held} selects (ids, each locked) back to the queue as RELEASE
    hands a job back, no attempt spent, or ends them canceled when a cancel is pending; :reason goes
    in each one's event. A row per job: its attempt, its worker and its new state. `also`: one more
    data-modifying WITH clause, run in the same statement."""
    return f"""
    WITH held AS ({held}
    ),{also} released AS (
        UPDATE jobs AS j
        SET state = CAST(CASE WHEN j.cancel_requested THEN 'canceled' ELSE 'queued' END AS job_state),
            max_attempts = j.max_attempts + CASE WHEN j.cancel_requested THEN 0 ELSE 1 END,
            run_after = now(), lease_expires_at = NULL, pid = NULL, progress = 0, progress_message = NULL,
            finished_at = CASE WHEN j.cancel_requested THEN now() END
        FROM held WHERE j.id = held.id
        RETURNING j.id, j.attempt, j.worker_id, j.model, j.state, j.progress
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CASE state WHEN 'canceled' THEN 'canceled' ELSE 'released' END, attempt, worker_id,
               jsonb_build_object('reason', CAST(:reason AS text))
        FROM released
        RETURNING id, job_id, kind
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM released WHERE state = 'queued'
    ), told AS ({_tell("released")}
    )
    SELECT id, attempt, worker_id, state, (SELECT count(*) FROM wake) AS woken,
           (SELECT count(*) FROM told) AS told
    FROM released
    """


# After a claim whose answer never came (the connection dropped once it had committed, maybe):
# jobs running under this worker's name that it does not hold (`:in_hand`) and that never started
# a model (no pid) go back. Without it they waited out their lease and came back as a lost worker's:
# an attempt spent and an abnormal death counted, for a run that never started.
RELEASE_UNKNOWN = text(
    _hand_back(
        """
        SELECT id FROM jobs
        WHERE worker_id = :worker_id AND state = 'running' AND pid IS NULL
          AND NOT (id = ANY(CAST(:in_hand AS uuid[])))
        FOR UPDATE SKIP LOCKED"""
    )
)

# A worker stopped at once (asked again while it stopped), its models and warm runners killed: every
# job still running under its name goes back. Left running, they waited for its restart or their
# leases, and came back as a crashed worker's (an attempt spent, an abnormal death counted). Its
# rows are locked in id order, as HEARTBEAT and SUCCEED lock theirs.
# The worker's row says `stopped` once its jobs are back, as after a graceful stop: left `stopping`,
# the other workers' reapers marked it dead and its heartbeat age grew in the metrics for a day.
RELEASE_STOPPED = text(
    _hand_back(
        """
        SELECT id FROM jobs WHERE worker_id = :worker_id AND state = 'running'
        ORDER BY id
        FOR UPDATE""",
        also="""
        gone AS (UPDATE workers SET state = 'stopped', heartbeat_at = now() WHERE id = :worker_id),""",
    )
)


# Retries whose time has come go back to the queue (and wake the workers). The rows are taken by
# key from an array: joined as `id IN (...)`, the planner, which expects most scheduled jobs to be
# due (finished jobs' `run_after` lies in the past), read the whole table to match them.
PROMOTE_DUE = text(
    f"""
    WITH due AS (
        UPDATE jobs SET state = 'queued'
        WHERE id = ANY(ARRAY(SELECT id FROM jobs WHERE state = 'scheduled' AND run_after <= now()
                             ORDER BY run_after LIMIT 1000 FOR UPDATE SKIP LOCKED))
        RETURNING model, id, state, attempt, progress
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM (SELECT DISTINCT model FROM due) AS m
    ), told AS ({_tell("due", None)}
    )
    SELECT (SELECT count(*) FROM due) AS promoted, (SELECT count(*) FROM wake) AS woken,
           (SELECT count(*) FROM told) AS told
    """
)

# Aging: a queued job's effective priority grows by one every :step_s it waits, up to :max_boost;
# the claim index orders by priority + age_boost. One chunk of the jobs whose next boost is due
# (one step after `boost_base_at`, their creation until the first), oldest due first: the index
# ix_jobs_boost_due finds them without reading the rest of the queue. Rows a claim holds are
# skipped, not waited for; a claim in turn skips only the chunk being written (about 50 ms for
# 1,000). A boost is only raised; a job at the most gets 'infinity' and is not read again.
# `seen` = the chunk's size.
AGE_QUEUED = text(
    """
    WITH due AS (
        SELECT id, age_boost AS was,
               CAST(LEAST(CAST(:max_boost AS integer),
                          floor(extract(epoch FROM now() - created_at) / CAST(:step_s AS float8)))
                    AS integer) AS boost
        FROM jobs
        WHERE state = 'queued'
          AND COALESCE(boost_base_at, created_at)
              <= now() - make_interval(secs => CAST(:step_s AS float8))
        ORDER BY COALESCE(boost_base_at, created_at)
        LIMIT :chunk
        FOR UPDATE SKIP LOCKED
    ), aged AS (
        UPDATE jobs AS j
        SET age_boost = GREATEST(due.was, due.boost),
            boost_base_at = CASE
                WHEN due.boost >= CAST(:max_boost AS integer) THEN CAST('infinity' AS timestamptz)
                ELSE j.created_at + due.boost * make_interval(secs => CAST(:step_s AS float8))
            END
        FROM due
        WHERE j.id = ANY(ARRAY(SELECT id FROM due)) AND j.id = due.id  -- by key, whatever the guess
        RETURNING due.boost > due.was AS raised
    )
    SELECT count(*) AS seen, count(*) FILTER (WHERE raised) AS raised FROM aged
    """
)


# -- leases -----------------------------------------------------------------------------------


# When a lease counts as run out: past its time, and not within `:lease_s` of PostgreSQL's start.
# While the database was away (stopped, restarting, crashed) no worker could renew a lease, so
# a lease that lapsed then says nothing of its worker: every lease gets one more `:lease_s` from
# the server's start to be renewed in, before any reaper may take its job back. (The reaper and
# the heartbeat use this one rule, so a lease the heartbeat may still renew is one no reaper
# takes, nor kills the processes of.) What the server cannot tell goes unseen: a network cut
# between the workers and a server that stayed up, or a failover to a standby started earlier;
# there leases run out as they would for a lost worker.
def _server_up_for(seconds: str) -> str:
    """SQL: PostgreSQL has been running (since its last start) for the bind parameter `seconds`."""
    return f"pg_postmaster_start_time() < now() - make_interval(secs => CAST(:{seconds} AS float8))"


_LEASE_RAN_OUT = f"lease_expires_at < now() AND {_server_up_for('lease_s')}"

# Renew the leases of the jobs this worker is running (`:ids`) and its own heartbeat (with its GPU
# snapshot, its state, and `:paused`: why it claims nothing now, NULL while it claims); returns
# those it still owns. A lease that ran out (`_LEASE_RAN_OUT`) is not renewed, even if no reaper
# took the job yet: another worker may be killing its process and taking it back. A job
# whose attempt died inside the worker is left to expire.
# But for a step of the database's clock: `stepped_s` is how much more time the database counts
# since this worker's last beat than the worker's own steady clock (`:since_s`), less
# `:tolerance_s`. A lease that ran out only by that much had not run out by real time, and every
# reaper holds off for a lease after such a step (reaper.Reaper.reap): it is renewed. A worker
# paused for a while counts the pause on its steady clock too: nothing is forgiven it.
# Its rows are locked in id order first, as SUCCEED locks its own: each locking several of the same
# rows in an order of its own, the two deadlocked, and PostgreSQL failed one (the worker stopped).
HEARTBEAT = text(
    f"""
    WITH step AS (
        SELECT coalesce(max(greatest(
            extract(epoch FROM now() - heartbeat_at) - CAST(:since_s AS float8) - :tolerance_s, 0)), 0)
            AS stepped_s
        FROM workers WHERE id = :worker_id
    ), held AS (
        SELECT id FROM jobs
        WHERE worker_id = :worker_id AND state = 'running' AND id = ANY(CAST(:ids AS uuid[]))
        ORDER BY id
        FOR NO KEY UPDATE
    ), renewed AS (
        UPDATE jobs SET lease_expires_at = now() + make_interval(secs => :lease_s)
        WHERE id = ANY(ARRAY(SELECT id FROM held))
          AND (NOT ({_LEASE_RAN_OUT})
               OR lease_expires_at + make_interval(secs => (SELECT stepped_s FROM step)) >= now())
        RETURNING id, attempt, cancel_requested
    ), me AS (
        UPDATE workers SET heartbeat_at = now(), gpus = CAST(:gpus AS jsonb), state = :state,
            paused = CAST(:paused AS text)
        WHERE id = :worker_id
    )
    SELECT step.stepped_s, r.id, r.attempt, r.cancel_requested FROM step LEFT JOIN renewed AS r ON true
    """
)

# Take back running jobs (those matched by {where}) from a worker that is gone: queue them again,
# or fail them when their attempts are used up, or cancel them if a cancel was asked for.
_TAKE_BACK = f"""
    WITH lost AS (
        -- `ends`: the job ends here (canceled, quarantined or failed) rather than queued again.
        SELECT id, cancel_requested OR attempt >= max_attempts OR abnormal_runs + 1 >= :quarantine_after
                   AS ends
        FROM jobs WHERE state = 'running' AND {{where}}
        ORDER BY lease_expires_at LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), back AS (
        UPDATE jobs AS j
        SET state = CAST(CASE
                WHEN j.cancel_requested THEN 'canceled'
                WHEN j.abnormal_runs + 1 >= :quarantine_after THEN 'quarantined'
                WHEN j.attempt >= j.max_attempts THEN 'failed'
                ELSE 'queued' END AS job_state),
            error = CAST(:reason AS text) || ' (worker ' || coalesce(j.worker_id, '?') || ', attempt '
                    || j.attempt || ')',
            abnormal_runs = j.abnormal_runs + 1,
            lease_expires_at = NULL, run_after = now(),
            finished_at = CASE WHEN lost.ends THEN now() END,
            -- Queued again, it shows no progress (as a job handed back does); one that ends here
            -- keeps what its run made. Its worker and pid stay: the lost run is found by them.
            progress = CASE WHEN lost.ends THEN j.progress ELSE 0 END,
            progress_message = CASE WHEN lost.ends THEN j.progress_message END
        FROM lost WHERE j.id = lost.id
        RETURNING j.id, j.attempt, j.worker_id, j.state, j.pid, j.host, j.model, j.progress
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CASE state WHEN 'queued' THEN 'recovered' ELSE state::text END, attempt,
               CAST(:by_worker AS text),
               jsonb_build_object('lost_worker', worker_id, 'reason', CAST(:reason AS text),
                                  'state', state)
        FROM back
        RETURNING id, job_id, kind
    ), wake AS (
        SELECT pg_notify('{{channel}}', model) FROM back WHERE state = 'queued'
    ), told AS ({_tell("back")}
    )
    SELECT id, attempt, worker_id, state, pid, host, (SELECT count(*) FROM wake) AS woken,
           (SELECT count(*) FROM told) AS told
    FROM back
"""

# Expired leases (`_LEASE_RAN_OUT`, by the caller's `:lease_s`), except the jobs the calling
# worker is running right now: after a database outage their leases may have lapsed, but their
# worker is alive and will renew or finish them.
# Of the jobs on the caller's own host (`:host`; NULL: no such rule) only those in `:cleared`
# are taken: the ones whose leftover processes it has just looked for and killed. A lease that
# ran out after that look waits for the next round, so the old run is gone before a new attempt
# of the job can start. A job on another host is left, for one more lease, to a live worker of
# that host, the only one that can kill what its run left there: taken from afar at once, it ran
# again while the dead worker's model ran on (holding its GPU), which no worker then looked for.
_LEFT_TO_ITS_HOST = """EXISTS (
        SELECT 1 FROM workers AS w
        WHERE w.host = jobs.host AND w.id IS DISTINCT FROM jobs.worker_id AND w.state = 'running'
          AND w.heartbeat_at > now() - make_interval(secs => :lease_s))
      AND lease_expires_at >= now() - make_interval(secs => :lease_s)"""
RECOVER_EXPIRED = text(
    _TAKE_BACK.format(
        where=f"{_LEASE_RAN_OUT} AND NOT (id = ANY(CAST(:in_hand AS uuid[])))"
        " AND (CAST(:host AS text) IS NULL OR id = ANY(CAST(:cleared AS uuid[]))"
        f" OR (host IS DISTINCT FROM CAST(:host AS text) AND NOT ({_LEFT_TO_ITS_HOST})))",
        channel=QUEUED_CHANNEL,
    )
)

# On start: this worker's own running jobs belong to its previous life; no need to wait.
REQUEUE_OWN = text(_TAKE_BACK.format(where="worker_id = :worker_id", channel=QUEUED_CHANNEL))

# Running jobs of this host about to be taken back: their model processes are killed first, so
# the old run is gone before a new attempt can start (found by pid, or by /proc when the run
# ended its worker before the pid was recorded).
LEFTOVERS_ON_HOST = text(
    f"""
    SELECT id, attempt, worker_id, state, pid, host FROM jobs
    WHERE state = 'running' AND host = :host
      AND (({_LEASE_RAN_OUT}) OR worker_id = CAST(:worker_id AS text))
    """
)

# The database's identity (Fleet.database_id).
DATABASE_ID = text("SELECT system_identifier::text || '/' || current_database() FROM pg_control_system()")
DATABASE_NAME = text("SELECT current_database()")

# How long ago, by the database's clock, a worker's row took its last beat.
HEARTBEAT_AGE = text("SELECT extract(epoch FROM now() - heartbeat_at) AS age_s FROM workers WHERE id = :id")

# Workers silent for :dead_after_s, by the database's clock and not within :dead_after_s of its
# start: no worker could heartbeat while it was away (as for leases, `_LEASE_RAN_OUT`).
MARK_DEAD_WORKERS = text(
    f"""
    UPDATE workers SET state = 'dead'
    WHERE state IN ('running', 'stopping')
      AND heartbeat_at < now() - make_interval(secs => :dead_after_s)
      AND {_server_up_for("dead_after_s")}
    RETURNING id
    """
)

REGISTER_WORKER = text(
    """
    INSERT INTO workers (id, host, pid, state, models, gpus, paused)
    VALUES (:id, :host, :pid, 'running', CAST(:models AS jsonb), CAST(:gpus AS jsonb), NULL)
    ON CONFLICT (id) DO UPDATE
    SET host = EXCLUDED.host, pid = EXCLUDED.pid, state = 'running', started_at = now(),
        heartbeat_at = now(), models = EXCLUDED.models, gpus = EXCLUDED.gpus, paused = NULL
    """
)

# A worker stopping beats on (its heartbeat says `stopping`): its heartbeat_at is left to its
# heartbeat, whose BeatClock counts from the last beat it took. Written here too, a step of the
# database's clock just before the stop was counted from after the step: the stopping worker's
# next beat saw none and refused the leases it had made run out, killing the runs it was finishing.
SET_WORKER_STATE = text(
    """
    UPDATE workers
    SET state = :state, heartbeat_at = CASE WHEN :state = 'stopped' THEN now() ELSE heartbeat_at END
    WHERE id = :id
    """
)

# -- user and admin actions -------------------------------------------------------------------

# Cancel: a queued or scheduled job ends `canceled` at once; a running one is flagged and its
# worker told (CANCEL_CHANNEL) to kill it. {seen}: the jobs asked for, (id, state,
# cancel_requested), each locked; only those queued, scheduled or running change, and a running
# one only once: asked again while its worker kills it (a client repeating its cancel), it wrote
# an event and two NOTIFYs every time, for as long as the kill or a dead worker's lease took.
_CANCEL = f"""
    WITH seen AS ({{seen}}
    ), target AS (
        SELECT id, state AS old_state FROM seen
        WHERE state IN ('queued', 'scheduled', 'quarantined') OR (state = 'running' AND NOT cancel_requested)
    ), changed AS (
        UPDATE jobs AS j
        SET cancel_requested = true,
            state = CAST(CASE WHEN target.old_state = 'running' THEN 'running'
                         ELSE 'canceled' END AS job_state),
            finished_at = CASE WHEN target.old_state = 'running' THEN NULL ELSE now() END,
            -- A quarantined job's run ended long before its cancel: moved past its start, so that
            -- the time it waited for an admin is not taken for run time (FINISHED_STATS).
            run_after = CASE WHEN target.old_state = 'quarantined' THEN now() ELSE j.run_after END
        FROM target WHERE j.id = target.id
        RETURNING j.id, j.state, j.attempt, j.worker_id, j.progress
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, CASE state WHEN 'canceled' THEN 'canceled' ELSE 'cancel_requested' END,
               attempt, worker_id, jsonb_build_object('by', CAST(:by AS text))
        FROM changed
        RETURNING id, job_id, kind
    ), wake AS (
        SELECT pg_notify('{CANCEL_CHANNEL}', id::text) FROM changed WHERE state = 'running'
    ), told AS ({_tell("changed")}
    )
"""

# A quarantined job is canceled too: dismissed by someone who will not retry it, it is finished
# for good, and retention (which keeps quarantined jobs for an admin) deletes its files in time.
# One job, by id. One row when the job exists for :owner: `seen_state` is the state the cancel
# found (it locks the row, so it is the newest), `state` the job's after it, NULL when that state
# refused the cancel. A refusal is worded from `seen_state`: the job read again afterwards may have
# moved on (an admin retry), and the 409 contradicted itself ("is queued; only queued ... can be
# canceled"). A running job already asked to stop is not changed, and answers as it did then.
CANCEL = text(
    _CANCEL.format(
        seen="""
        SELECT id, state, attempt, cancel_requested FROM jobs
        WHERE id = :id AND (CAST(:owner AS text) IS NULL OR owner = :owner)
        FOR UPDATE"""
    )
    + """
    SELECT seen.state AS seen_state,
           COALESCE(changed.state, CASE WHEN seen.state = 'running' AND seen.cancel_requested
                                        THEN seen.state END) AS state,
           COALESCE(changed.attempt, seen.attempt) AS attempt,
           (SELECT count(*) FROM wake) AS woken, (SELECT count(*) FROM told) AS told
    FROM seen LEFT JOIN changed ON changed.id = seen.id
    """
)

# The jobs an admin's bulk cancel takes: in :state, submitted by :before (a flood still arriving
# cannot keep it going), of :model and :owner (NULL: any), not already asked to stop (a running
# job stays running until its worker ends it, and must not be taken again).
_CANCELABLE = """
        SELECT id, state, cancel_requested FROM jobs
        WHERE state = CAST(:state AS job_state) AND created_at <= :before
          AND (CAST(:model AS text) IS NULL OR model = :model)
          AND (CAST(:owner AS text) IS NULL OR owner = :owner)
          AND NOT cancel_requested"""

# One batch of a bulk cancel: at most :limit of them, a row per job changed (`state` after it).
# Batches, not one statement: each batch is its own short transaction, so it holds at most :limit
# row locks, for milliseconds, however many jobs match. SKIP LOCKED: a row that a claim, an aging
# pass, a heartbeat or a finishing run holds is passed over, not waited for; waiting, this could
# deadlock with a statement locking the same rows in another order (a heartbeat: it would stop
# that worker). The caller takes batches until none is left (CANCELABLE_LEFT), so a row passed
# over is taken by a later batch once its holder commits.
CANCEL_MATCHING = text(
    _CANCEL.format(seen=f"{_CANCELABLE}\n        LIMIT :limit\n        FOR UPDATE SKIP LOCKED")
    + """
    SELECT id, state, attempt, (SELECT count(*) FROM wake) AS woken, (SELECT count(*) FROM told) AS told
    FROM changed
    """
)

# Whether any job a bulk cancel would take is left (held by another statement when last tried),
# and how many, once it gives up on them.
CANCELABLE_LEFT = text(f"SELECT EXISTS ({_CANCELABLE}) AS remaining")
CANCELABLE_COUNT = text(f"SELECT count(*) AS remaining FROM ({_CANCELABLE}) AS matching")

# Admin retry: a failed or canceled job is queued again with a fresh budget of attempts.
# `attempt` keeps counting (fencing needs it to only grow); `max_attempts` moves up instead.
# {picked}: the jobs to retry, (id, state, expired_at), each locked; only those that can be are.
_RETRY = f"""
    WITH picked AS ({{picked}}
    ), retried AS (
        UPDATE jobs
        SET state = 'queued', max_attempts = attempt + :attempts, run_after = now(),
            error = NULL, cancel_requested = false, started_at = NULL, finished_at = NULL, progress = 0,
            progress_message = NULL, results = '[]'::jsonb, lease_expires_at = NULL, pid = NULL,
            abnormal_runs = 0, oom_retries = 0
        FROM picked
        WHERE jobs.id = picked.id
          AND picked.state IN ('failed', 'canceled', 'quarantined') AND picked.expired_at IS NULL
        RETURNING jobs.id, jobs.attempt, jobs.model, jobs.state, jobs.progress
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, detail)
        SELECT id, 'retried', attempt, jsonb_build_object('by', CAST(:by AS text)) FROM retried
        RETURNING id, job_id, kind
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM (SELECT DISTINCT model FROM retried) AS m
    ), told AS ({_tell("retried")}
    )
"""

# One job, by id. One row when it exists: `seen_state` and `expired` as the retry found them (the
# row locked: the newest), `id` NULL when they refused it (worded from them, as CANCEL says why).
RETRY_ONE = text(
    _RETRY.format(picked="SELECT id, state, expired_at FROM jobs WHERE id = :id FOR UPDATE")
    + """
    SELECT picked.state AS seen_state, picked.expired_at IS NOT NULL AS expired, retried.id,
           (SELECT count(*) FROM wake) AS woken, (SELECT count(*) FROM told) AS told
    FROM picked LEFT JOIN retried ON retried.id = picked.id
    """
)

# The jobs an admin's bulk retry takes: failed or quarantined, not expired, of :model, with
# :error_contains in their error, finished in [:since, :until) (NULL: any) and by :before, when the
# retry began: a job it queued that fails again meanwhile is not taken again, round after round.
_RETRYABLE = """
        SELECT id, state, expired_at FROM jobs
        WHERE state IN ('failed', 'quarantined') AND expired_at IS NULL AND finished_at <= :before
          AND (CAST(:model AS text) IS NULL OR model = :model)
          AND (CAST(:error_contains AS text) IS NULL
               OR strpos(coalesce(error, ''), :error_contains) > 0)
          AND (CAST(:since AS timestamptz) IS NULL OR finished_at >= :since)
          AND (CAST(:until AS timestamptz) IS NULL OR finished_at < :until)"""

# One batch of a bulk retry: at most :limit of them, oldest failures first, a row per job queued
# again. Batches, as a bulk cancel takes them (CANCEL_MATCHING says why): each its own short
# transaction holding at most :limit row locks, SKIP LOCKED; the caller sizes :limit to the room
# left under the queue limit (WAITING_UP_TO), and counts what it leaves (RETRYABLE_LEFT).
RETRY_BATCH = text(
    _RETRY.format(
        picked=f"{_RETRYABLE}\n        ORDER BY finished_at, id\n        LIMIT :limit FOR UPDATE SKIP LOCKED"
    )
    + "SELECT id, (SELECT count(*) FROM wake) AS woken, (SELECT count(*) FROM told) AS told FROM retried"
)

# How many jobs a bulk retry leaves: matching ones held by other statements, or beyond the room.
RETRYABLE_LEFT = text(f"SELECT count(*) AS remaining FROM ({_RETRYABLE}) AS matching")

# How many of the jobs a bulk retry matches are of none of the :known models (the API's registry):
# it leaves them, as no worker of that registry would run them, and says how many.
RETRYABLE_UNSERVED = text(
    f"SELECT count(*) AS unserved FROM ({_RETRYABLE}) AS matching JOIN jobs USING (id)"
    " WHERE jobs.model <> ALL(CAST(:known AS text[]))"
)

# The jobs waiting (queued or scheduled), up to :queue_limit, counted as ENQUEUE counts them.
WAITING_UP_TO = text(f"SELECT {_WAITING}")

# A bulk retry's batch counts the room and fills it while holding this transaction-level lock, so
# two bulk retries at once never both fill the room one count saw.
BULK_RETRY_LOCK_KEY = 0x67706A_72657472  # "gpj" "retr"
XACT_LOCK = text("SELECT pg_advisory_xact_lock(:key)")

JOB_STATE = text("SELECT state FROM jobs WHERE id = :id AND (CAST(:owner AS text) IS NULL OR owner = :owner)")

EVENTS = text(
    """
    SELECT e.id, e.at, e.kind, e.attempt, e.worker_id, e.detail
    FROM job_events AS e JOIN jobs AS j ON j.id = e.job_id
    WHERE e.job_id = :id AND (CAST(:owner AS text) IS NULL OR j.owner = :owner)
    ORDER BY e.id
    """
)

# -- observability ----------------------------------------------------------------------------

# Events that move a job through its life; the metrics pair each with the one before it.
LIFECYCLE_KINDS = (
    "submitted", "claimed", "retry_scheduled", "recovered", "released", "retried", "out_of_memory",
    "succeeded", "failed", "canceled", "quarantined",
)  # fmt: skip

# Events after :after in id order, each with what the metrics need: the job's model, seconds since
# the job was created, and the job's previous lifecycle event (its kind, and seconds since the
# moment it made the job eligible: a scheduled retry counts from its run_after).
EVENTS_FOR_METRICS = text(
    """
    SELECT e.id, e.kind, j.model, e.detail -> 'lost_worker' IS NOT NULL AS taken_back,
           extract(epoch FROM e.at - j.created_at) AS since_created_s,
           p.kind AS prev_kind, extract(epoch FROM e.at - p.eligible_at) AS since_prev_s
    FROM job_events AS e
    JOIN jobs AS j ON j.id = e.job_id
    LEFT JOIN LATERAL (
        SELECT p.kind, GREATEST(p.at, CASE WHEN p.kind = 'retry_scheduled'
                                      THEN CAST(p.detail ->> 'run_after' AS timestamptz) END) AS eligible_at
        FROM job_events AS p
        WHERE e.kind = ANY(CAST(:kinds AS text[]))
          AND p.job_id = e.job_id AND p.id < e.id AND p.kind = ANY(CAST(:kinds AS text[]))
        ORDER BY p.id DESC
        LIMIT 1
    ) AS p ON true
    WHERE e.id > :after
    ORDER BY e.id
    LIMIT :limit
    """
)

# The highest event id inserted over :older_than_s ago by the database's clock (none: no such
# event): where a new process's tally of the history in SQL stops (EVENT_GROUPS_FOR_METRICS) and
# its reading row by row begins. An event takes its id and its `at` as it is inserted, so a hole
# below it is an insert begun that long ago and not committed yet, given up as the tally's Ledger
# gives up a hole. Walks the primary key down from the newest id: the last :older_than_s of events.
EVENTS_CUTOFF_FOR_METRICS = text(
    """
    SELECT id FROM job_events
    WHERE at < clock_timestamp() - make_interval(secs => CAST(:older_than_s AS double precision))
    ORDER BY id DESC
    LIMIT 1
    """
)

# For the rest of the transaction, statements may run :ms milliseconds, whatever statement_timeout
# the server sets for the role or database (for short requests): the count of a long history.
STATEMENT_TIMEOUT_LOCAL = text("SELECT set_config('statement_timeout', :ms, true)")

# For the rest of the transaction, plan without index scans: EVENT_GROUPS_FOR_METRICS reads every
# event, and PostgreSQL chose to walk ix_job_events_job for the window's order (job, id), one heap
# page at random per event: 24-27 s beside 1,000,000 jobs (4.77 million events) on the 2-core VM,
# against 11-15 s to read the table in order and sort it.
SCAN_WHOLE_TABLES = text(
    "SELECT set_config('enable_indexscan', 'off', true), set_config('enable_bitmapscan', 'off', true)"
)

# The lifecycle events up to id :upto, counted in groups alike for the metrics: the columns of
# EVENTS_FOR_METRICS (the previous lifecycle event of the job by a window, not a lookup per event),
# with the seconds since the previous event and since the job's creation (the latter only for the
# :final kinds, the only ones that observe it) clamped at 0, each put in its histogram bucket and
# summed. A bucket is how many bounds lie below the value (a value equal to a bound is in that
# bound's bucket, `le`), which width_bucket counts over :bucket_starts, each bound plus one ulp.
EVENT_GROUPS_FOR_METRICS = text(
    """
    WITH e AS (
        SELECT e.kind, j.model, e.detail -> 'lost_worker' IS NOT NULL AS taken_back,
               lag(e.kind) OVER w AS prev_kind,
               GREATEST(extract(epoch FROM e.at - lag(
                   GREATEST(e.at, CASE WHEN e.kind = 'retry_scheduled'
                                       THEN CAST(e.detail ->> 'run_after' AS timestamptz) END)
               ) OVER w), 0) AS since_prev_s,
               CASE WHEN e.kind = ANY(CAST(:final AS text[]))
                    THEN GREATEST(extract(epoch FROM e.at - j.created_at), 0) END AS since_created_s
        FROM job_events AS e
        JOIN jobs AS j ON j.id = e.job_id
        WHERE e.id <= :upto AND e.kind = ANY(CAST(:kinds AS text[]))
        WINDOW w AS (PARTITION BY e.job_id ORDER BY e.id)
    )
    SELECT model, kind, prev_kind, taken_back, count(*) AS events,
           width_bucket(CAST(since_prev_s AS float8), CAST(:bucket_starts AS float8[])) AS prev_bucket,
           sum(since_prev_s) AS since_prev_s,
           width_bucket(CAST(since_created_s AS float8), CAST(:bucket_starts AS float8[]))
               AS created_bucket,
           sum(since_created_s) AS since_created_s
    FROM e
    GROUP BY model, kind, prev_kind, taken_back, prev_bucket, created_bucket
    """
)

# Jobs that are not finished, by state, model and priority (each state through its own index).
QUEUE_DEPTH = text(
    "\n    UNION ALL\n".join(
        f"""
    (SELECT CAST('{state}' AS text) AS state, model, priority, count(*) AS jobs
     FROM jobs WHERE state = '{state}' GROUP BY model, priority)"""
        for state in ("queued", "scheduled", "running")
    )
)

# Workers alive or seen within :recent_s, with their GPU snapshot (from the last heartbeat) and the
# jobs they are running now.
WORKERS = text(
    """
    SELECT w.id, w.host, w.pid, w.state, w.started_at, w.heartbeat_at, w.models, w.gpus, w.paused,
           extract(epoch FROM now() - w.heartbeat_at) AS heartbeat_age_s,
           coalesce(r.jobs, CAST('{}' AS uuid[])) AS running_jobs
    FROM workers AS w
    LEFT JOIN LATERAL (
        SELECT array_agg(j.id ORDER BY j.started_at) AS jobs
        FROM jobs AS j WHERE j.worker_id = w.id AND j.state = 'running'
    ) AS r ON true
    WHERE w.state IN ('running', 'stopping') OR w.heartbeat_at > now() - make_interval(secs => :recent_s)
    ORDER BY w.id
    """
)

# Jobs that finished within :window_s: counts, failures, and wait / run percentiles (wait: from
# submission to the start of the last attempt; run: that attempt's start to the end, for the jobs
# that ended in a run: not one canceled while it waited for a retry, see Job.ended_waiting).
FINISHED_STATS = text(
    """
    WITH recent AS (
        SELECT state, created_at, started_at, finished_at, run_after FROM jobs
        WHERE finished_at > now() - make_interval(secs => :window_s)
    )
    SELECT count(*) AS finished,
           count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE state IN ('failed', 'quarantined')) AS failed,
           count(*) FILTER (WHERE finished_at > now() - make_interval(secs => :recent_s)) AS recent,
           percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (
               ORDER BY extract(epoch FROM started_at - created_at)
           ) FILTER (WHERE started_at IS NOT NULL) AS wait_s,
           percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (
               ORDER BY extract(epoch FROM finished_at - started_at)
           ) FILTER (WHERE started_at >= run_after) AS run_s
    FROM recent
    """
)

# -- retention --

# One process at a time prunes (session-level advisory lock, held on its own connection).
RETENTION_LOCK_KEY = 0x67706A_7072756E  # "gpj" "prun"
TRY_LOCK = text("SELECT pg_try_advisory_lock(:key)")
# The database's clock: ages of jobs are measured by it (`finished_at`), never by a host's.
NOW = text("SELECT now() AS now")
UNLOCK = text("SELECT pg_advisory_unlock(:key)")

# Finished jobs that still have their files and finished before :cutoff, oldest first (this is
# the predicate of ix_jobs_retention). Queued, scheduled and running jobs never match.
_EXPIRABLE = """
    SELECT id FROM jobs
    WHERE expired_at IS NULL AND state IN ('succeeded', 'failed', 'canceled') AND finished_at < :cutoff
    ORDER BY finished_at
    LIMIT :limit
"""

EXPIRABLE = text(_EXPIRABLE)

# Mark a batch expired (links then answer 410) and write an `expired` event for each. The batch
# is updated through its ids as an array, read by primary key: joined to `picked`, the update
# hashed the whole `jobs` table to find its 500 rows below about 100,000 jobs (beside 20,000 on
# PostgreSQL 15: 32 ms a batch, 23 ms by key; tests/integration/test_retention_plans.py).
EXPIRE = text(
    f"""
    WITH picked AS ({_EXPIRABLE} FOR UPDATE SKIP LOCKED
    ), expired AS (
        UPDATE jobs AS j SET expired_at = now() WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
        RETURNING j.id, j.attempt, j.input_id
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, detail)
        SELECT id, 'expired', attempt, jsonb_build_object('by', 'retention') FROM expired
    )
    SELECT id, input_id FROM expired
    """
)

# The jobs of `:ids` (a batch of 500, or 1,000 the sweep asks about), by primary key. Given the
# list itself, the planner weighed its length against the table and read `jobs` whole below about
# 200,000 rows (the sweep's question: 23 ms beside 100,000 on PostgreSQL 15, 4 ms by key); through
# ARRAY(SELECT ...) it cannot see the length, guesses ten, and probes the index. Sets found inside
# a statement (`candidate`, `unused`) are read by index the same way.
_GIVEN_IDS = "ANY(ARRAY(SELECT unnest(CAST(:ids AS uuid[]))))"

# Lock the inputs of :ids before DETACH_UNUSED_INPUTS reads which are still used (a statement of
# its own, so that read's snapshot comes after the wait): an upload that found one of these images
# holds its row until its job is committed, and one that comes later waits for this transaction
# (ENQUEUE says why). An upload locks one image, and one prune runs at a time: no deadlock.
LOCK_INPUTS = text(
    f"""
    SELECT id FROM inputs
    WHERE id = ANY(ARRAY(SELECT input_id FROM jobs WHERE id = {_GIVEN_IDS}))
    ORDER BY id
    FOR UPDATE
    """
)

# Inputs of :ids that no unexpired job uses any more: detach them from their (expired) jobs.
DETACH_UNUSED_INPUTS = text(
    f"""
    WITH candidate AS (
        SELECT DISTINCT input_id FROM jobs
        WHERE id = {_GIVEN_IDS} AND input_id IS NOT NULL
    ), unused AS (
        SELECT input_id FROM candidate
        EXCEPT
        SELECT input_id FROM jobs
        WHERE expired_at IS NULL AND input_id = ANY(ARRAY(SELECT input_id FROM candidate))
    ), detached AS (
        UPDATE jobs SET input_id = NULL WHERE input_id = ANY(ARRAY(SELECT input_id FROM unused))
    )
    SELECT input_id FROM unused
    """
)

DELETE_INPUTS = text("DELETE FROM inputs WHERE id = ANY(CAST(:ids AS bigint[])) RETURNING id, bytes")

# Which of :ids are expired (their leftover files may go).
EXPIRED_AMONG = text(f"SELECT id FROM jobs WHERE id = {_GIVEN_IDS} AND expired_at IS NOT NULL")


# -- scheduling -------------------------------------------------------------------------------

# Out of GPU memory: queue the job again at once with a larger VRAM estimate, without spending an
# attempt (the budget grows by one, as `attempt` must only grow).
REQUEUE_OOM = text(
    f"""
    WITH grown AS (
        UPDATE jobs
        SET state = 'queued', vram_mb = :vram_mb, oom_retries = oom_retries + 1,
            max_attempts = max_attempts + 1, error = :error, lease_expires_at = NULL, pid = NULL,
            run_after = now(), progress = 0, progress_message = NULL
        WHERE id = :id AND attempt = :attempt AND state = 'running' AND NOT cancel_requested
        RETURNING id, attempt, worker_id, model, state, progress
    ), event AS (
        INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)
        SELECT id, 'out_of_memory', attempt, worker_id, CAST(:detail AS jsonb) FROM grown
        RETURNING id, job_id, kind
    ), wake AS (
        SELECT pg_notify('{QUEUED_CHANNEL}', model) FROM grown
    ), told AS ({_tell("grown")}
    )
    SELECT id, (SELECT count(*) FROM wake) AS woken, (SELECT count(*) FROM told) AS told FROM grown
    """
)

# The largest GPU memory this attempt's processes were seen using (NVML).
RECORD_PEAK = text(
    """
    UPDATE jobs SET vram_peak_mb = GREATEST(coalesce(vram_peak_mb, 0), :peak_mb)
    WHERE id = :id AND attempt = :attempt AND state = 'running'
    RETURNING id
    """
)

# The best queued job that fits none of the budgets now but one of the GPUs when empty: probed per
# (model, size class) like the claim, without locking anything.
WAITING_HEAD = text(
    """
    SELECT head.id, head.vram_mb, head.effective, extract(epoch FROM now() - head.created_at) AS waited_s
    FROM unnest(CAST(:models AS text[])) AS m(model)
    CROSS JOIN unnest(CAST(:classes AS smallint[])) AS k(cls)
    CROSS JOIN LATERAL (
        SELECT j.id, j.vram_mb, j.priority + j.age_boost AS effective, j.created_at
        FROM jobs AS j
        WHERE j.state = 'queued' AND j.model = m.model AND j.vram_class = k.cls
          AND j.vram_mb > :budget AND j.vram_mb <= :capacity
        ORDER BY j.priority + j.age_boost DESC, j.created_at
        LIMIT 1
    ) AS head
    ORDER BY head.effective DESC, head.created_at
    LIMIT 1
    """
)

# Run time by model as a line over input megapixels, from recent successes (backfill estimates).
RUN_TIMES = text(
    """
    SELECT model, count(*) AS samples, avg(run_s) AS mean_s,
           regr_intercept(run_s, megapixels) AS intercept_s, regr_slope(run_s, megapixels) AS slope_s
    FROM (
        SELECT model, megapixels, extract(epoch FROM finished_at - started_at) AS run_s
        FROM jobs
        WHERE state = 'succeeded' AND finished_at > now() - interval '7 days'
        ORDER BY finished_at DESC LIMIT 5000
    ) AS recent
    GROUP BY model
    """
)

# Per model, the largest GPU (total MB) that a worker serving it reported, among the workers alive
# or seen within :recent_s: what a learned estimate above the declared one may grow to.
LARGEST_GPUS = text(
    """
    SELECT m.model,
           max(coalesce(CAST(g.gpu ->> 'offered_mb' AS integer),
                        CAST(g.gpu ->> 'total_mb' AS integer) - :buffer_mb)) AS offered_mb
    FROM workers AS w
    CROSS JOIN LATERAL jsonb_array_elements_text(w.models) AS m(model)
    CROSS JOIN LATERAL jsonb_array_elements(w.gpus) AS g(gpu)
    WHERE w.state IN ('running', 'stopping') OR w.heartbeat_at > now() - make_interval(secs => :recent_s)
    GROUP BY m.model
    """
)

# Observed peak ÷ declared estimate per model, from recent runs that recorded a peak.
VRAM_RATIOS = text(
    """
    SELECT model, array_agg(vram_peak_mb::real / declared_vram_mb ORDER BY finished_at DESC) AS ratios,
           max(vram_peak_mb) AS max_peak_mb
    FROM (
        SELECT model, vram_peak_mb, declared_vram_mb, finished_at FROM jobs
        WHERE vram_peak_mb IS NOT NULL AND declared_vram_mb > 0 AND state = 'succeeded'
        ORDER BY finished_at DESC LIMIT 5000
    ) AS recent
    GROUP BY model
    """
)
