"""Settings: every knob of the service, read from `GPUJOBS_*` environment variables.

Only `cli.py` and `api/` call `get_settings()`; everything else takes plain arguments.
"""

from __future__ import annotations

import functools
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app import checkout, dsn, errors, gpu

# The longest duration a setting may name: ten years. Longer ones are mistakes, and reach past what
# PostgreSQL's timestamps hold once added to or taken from now() (a lease of 1e12 s killed the reaper).
LONGEST_S = 10 * 365 * 86_400
# A duration setting: its field adds the lower bound and the description.
Seconds = Annotated[float, Field(le=LONGEST_S)]
WholeSeconds = Annotated[int, Field(le=LONGEST_S)]
# The bound of every count among the settings: PostgreSQL's integer. Those that reach SQL as a
# parameter failed there past it (a worker's start, every POST /jobs), far from the variable.
PG_INT_MAX = 2**31 - 1
# The priority of a job that asks for none (POST /jobs, `gpujobs submit`, the web form's default).
DEFAULT_PRIORITY = 0


class Settings(BaseSettings):
    """The service's configuration. Field docs are the README's configuration table."""

    # allow_inf_nan: `inf` passed every `ge=0`, and an endless lease or delay broke SQL intervals.
    model_config = SettingsConfigDict(
        env_prefix="GPUJOBS_", env_file=None, extra="ignore", allow_inf_nan=False
    )

    database_url: str | None = Field(
        None,
        description="PostgreSQL URL; its query may hold host, port, user, password, database, passfile, "
        "target_session_attrs and ssl (or libpq's sslmode: disable ... verify-full); a socket folder as "
        "?host=/run/postgresql or as libpq writes it, postgresql://%2Frun%2Fpostgresql/db; unset = "
        "embedded PostgreSQL in <storage_dir>/pgdata",
    )
    storage_dir: Path = Field(
        checkout.STORAGE,
        description="Result files, logs, scratch, embedded database; unset = the `storage` folder of the "
        "gpujobs checkout, wherever a command runs (a relative path is taken from the current folder)",
    )
    host: str = Field("127.0.0.1", description="Address the API binds to")
    port: int = Field(8000, ge=1, le=65535, description="Port the API binds to")
    max_upload_mb: float = Field(20, gt=0, le=4096, description="Largest accepted upload, in MB")
    max_image_megapixels: float = Field(
        64, gt=0, le=1000, description="Largest accepted image, in megapixels (decompression bombs)"
    )
    queue_limit: int = Field(
        10_000,
        ge=1,
        le=PG_INT_MAX,
        description="Most queued jobs; POST /jobs answers 429 when full (in the last tenth each upload "
        "counts, and uploads written at the same moment may pass it by up to GPUJOBS_UPLOAD_WRITERS per "
        "API process; below that, each API process checks against a count at most 1 s old)",
    )
    queue_limit_per_key: int = Field(
        100,
        ge=0,
        le=PG_INT_MAX,
        description="Most queued jobs per principal (its keys share it); 429 beyond (uploads written at "
        "the same moment may pass it by up to GPUJOBS_UPLOAD_WRITERS per API process); 0 = no limit",
    )
    uploads_per_key: int = Field(
        8,
        ge=0,
        le=PG_INT_MAX,
        description="Uploads (POST /jobs) one principal (its keys together) may have in progress at once "
        "in each API process; 429 with Retry-After beyond, before the body is read (0 = no limit)",
    )
    upload_writers: int = Field(
        4,
        ge=0,
        le=PG_INT_MAX,
        description="Uploads written to the database at once; the rest wait their turn in the API, "
        "first come first served (0 = no limit)",
    )
    # Within PostgreSQL's integer, with room for what aging adds: -10^9 to 10^9.
    priority_min: int = Field(
        -100, ge=-(10**9), le=10**9, description="Lowest priority a job may ask for (at most 0)"
    )
    priority_max: int = Field(
        100, ge=-(10**9), le=10**9, description="Highest priority a job may ask for (at least 0)"
    )
    lease_s: Seconds = Field(20, gt=0, description="How long a claimed job's lease lasts without a heartbeat")
    heartbeat_interval_s: Seconds = Field(5, gt=0, description="How often a worker renews its leases")
    poll_interval_s: Seconds = Field(2, gt=0, description="Claim poll when no NOTIFY arrives (fallback)")
    claim_gather_s: float = Field(
        0.001,
        ge=0,
        le=1,
        description="When a job ends while others still run, wait this long before claiming, so "
        "slots freed together are filled by one claim; the ended jobs' successes wait for that claim "
        "(5 ms longer at most) and are written in its statement (0 = claim at once; successes are then "
        "written on their own)",
    )
    claim_ahead_s: float = Field(
        0.05,
        ge=0,
        le=60,
        description="With a cap on jobs per GPU: for each job in hand of a model whose recent runs "
        "took less than this, one more job is claimed, to start as a slot frees (it holds its VRAM "
        "and lease while it waits; 0 = claim only for free slots)",
    )
    reap_interval_s: Seconds = Field(5, gt=0, description="How often a worker looks for expired leases")
    worker_name: str = Field(
        "", description="Worker name; its identity is <host>:<name> (empty: worker), one live worker each"
    )
    run_worker: bool = Field(True, description="`gpujobs serve` also runs a worker in the same process")
    api_processes: int = Field(
        1,
        ge=1,
        le=64,
        description="API processes `gpujobs serve` runs on its one port (uploads use a core each); "
        "the worker, if any, runs in the first",
    )
    gpus: str | None = Field(None, description='Virtual GPUs when NVML is absent, e.g. "24GiB,24GiB"')
    virtual_gpu_mb: int = Field(
        24_576, gt=0, le=gpu.MAX_GPU_MB, description="Size of the one virtual GPU when gpus is unset"
    )
    vram_buffer_mb: int = Field(512, ge=0, le=gpu.MAX_GPU_MB, description="VRAM kept free on every GPU")
    # The claim adds jobs claimed ahead to it, in PostgreSQL's int[].
    max_jobs_per_gpu: int = Field(
        0, ge=0, le=10_000, description="Cap on concurrent jobs per GPU (0 = only VRAM)"
    )
    models_file: Path | None = Field(None, description="Extra model registry TOML file")
    link_secret: str | None = Field(
        None, description="HMAC secret for download links; unset = generated once in storage_dir"
    )
    link_ttl_s: WholeSeconds = Field(3600, gt=0, description="How long a download link stays valid")
    public_metrics: bool = Field(True, description="GET /metrics needs no API key (false: an admin key)")
    public_docs: bool = Field(True, description="/docs and /openapi.json need no API key")
    cors_origins: str = Field(
        "", description="Browser origins that may call the API, comma-separated (https://app.example.com)"
    )
    kill_grace_s: Seconds = Field(5, ge=0, description="Seconds between SIGTERM and SIGKILL of a model")
    shutdown_grace_s: Seconds = Field(30, ge=0, description="On SIGTERM, how long running jobs may finish")
    max_log_mb: float = Field(
        16,
        ge=0,
        description="Largest log file, in MB: past it a job's log keeps its start and its last lines, "
        "a warm runner's runner.log rotates to runner.log.1 (0 = no cap)",
    )
    retry_base_s: Seconds = Field(
        5, ge=0, description="First retry delay; doubles with each failure (jitter)"
    )
    retry_max_s: Seconds = Field(600, ge=0, description="Longest retry delay")
    # Scheduling (README "Scheduling"): aging, reservations and backfill, learned VRAM, OOM, quarantine.
    age_step_s: float = Field(60, gt=0, description="A queued job gains one priority point per this wait")
    age_max_boost: int = Field(10, ge=0, le=1000, description="Most priority points a job gains by waiting")
    reserve_after_s: Seconds = Field(
        120,
        ge=0,
        description="The top job that fits no GPU gets a GPU held for it after this wait",
    )
    backfill_min_samples: int = Field(
        5,
        ge=1,
        le=PG_INT_MAX,
        description="Finished runs of a model needed before it may backfill a held GPU",
    )
    learned_vram_min_samples: int = Field(
        20,
        ge=1,
        le=PG_INT_MAX,
        description="Observed peaks of a model needed before its VRAM estimate is learned",
    )
    learned_vram_percentile: float = Field(95, gt=0, le=100, description="Percentile of observed peaks used")
    learned_vram_margin_mb: int = Field(
        256, ge=0, le=gpu.MAX_GPU_MB, description="Added to the learned VRAM estimate"
    )
    learned_vram_above_declared: bool = Field(
        False,
        description="Let a learned estimate exceed the model's declared maximum (not the largest GPU seen)",
    )
    oom_max_retries: int = Field(
        2, ge=0, le=PG_INT_MAX, description="Out-of-memory re-queues with a larger estimate"
    )
    oom_growth: float = Field(1.5, gt=1, description="Factor the VRAM estimate grows by after an OOM")
    gpu_settle_timeout_s: Seconds = Field(
        30,
        ge=0,
        description="How long NVML may take to show a job's GPU memory taken (from its start) or freed",
    )
    warm_idle_s: Seconds = Field(300, gt=0, description="A warm runner with no job for this long is stopped")
    warm_paced: bool = Field(
        False,
        description="A job that finds its model's warm runners busy waits for one, unless the jobs "
        "waiting would wait longer than a runner takes to start (false: each such job starts its own)",
    )
    warm_streak_max: int = Field(
        4,
        ge=0,
        le=PG_INT_MAX,
        description="Claims in a row that may take jobs of models with a warm runner first, among equal "
        "priorities; the next claim takes the oldest (0 = never prefer)",
    )
    claim_batch: int = Field(
        16, ge=1, le=256, description="Most jobs a worker claims in one statement when several slots are free"
    )
    quarantine_after: int = Field(
        3,
        ge=1,
        le=PG_INT_MAX,
        description="Abnormal deaths (signals, warm runners dying mid-job, lost workers) before a job is "
        "quarantined",
    )
    log_level: str = Field("INFO", description="Log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as readable text, or one JSON object per line"
    )
    metrics_cache_s: Seconds = Field(
        5, ge=0, description="How long /metrics reuses what it read from the database"
    )
    ready_min_workers: int = Field(
        0,
        ge=0,
        le=PG_INT_MAX,
        description="/readyz answers 503 while fewer live workers heartbeat (0 = never)",
    )
    # At most 50: a client reading a stream takes a minute of silence for a lost connection
    # (`gpujobs submit`; nginx's proxy_read_timeout is 60 s too).
    stream_keepalive_s: float = Field(
        15, gt=0, le=50, description="Comment line sent on an idle job stream (at most 50)"
    )
    streams_per_key: int = Field(
        32,
        ge=0,
        le=PG_INT_MAX,
        description="Event streams (GET /jobs/{id}/stream) one principal (its keys together) may hold open "
        "at once in each API process; 429 with Retry-After beyond (0 = no limit)",
    )
    client_timeout_s: Seconds = Field(
        30,
        gt=0,
        description="How long a client may take to send a request's line and headers (from its "
        "connection or its previous answer), pause while sending a body, or stop taking an answer; "
        "then 408 (for an answer: none) and the connection is closed",
    )
    upload_min_kb_per_s: float = Field(
        8,
        ge=0,
        le=1_048_576,
        description="Slowest average rate, in KB/s, at which a request body (an upload) may arrive, counted "
        "from its start after a grace of GPUJOBS_CLIENT_TIMEOUT_S; slower: 408 and the connection is "
        "closed (0 = no minimum)",
    )
    retention_days: float = Field(
        30,
        ge=0,
        le=36_500,
        description="Finished jobs older than this lose their files and inputs (0 = keep all)",
    )
    retention_interval_s: Seconds = Field(3600, gt=0, description="How often a worker runs retention")

    @field_validator("database_url")
    @classmethod
    def _asyncpg_driver(cls, value: str | None) -> str | None:
        """Accept postgres:// and postgresql:// URLs that asyncpg can use; always use asyncpg."""
        return None if value is None else dsn.asyncpg_url(value)

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, values: object) -> object:
        """A blank setting (an env file's `NAME=`) is unset: its default. Else GPUJOBS_HOST= was the
        host "" (every interface), GPUJOBS_MODELS_FILE= and GPUJOBS_STORAGE_DIR= the folder `.`."""
        if not isinstance(values, dict):
            return values
        return {k: v for k, v in values.items() if not (isinstance(v, str) and not v.strip())}

    @field_validator("gpus")
    @classmethod
    def _gpu_sizes(cls, value: str | None) -> str | None:
        """Reject an unreadable GPU list at start, not at the first claim."""
        if value:
            try:
                gpu.parse_sizes(value)
            except errors.ConfigError as exc:
                raise ValueError(exc.message) from exc
        return value or None

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        """Each origin is `*` or scheme://host[:port], without a path."""
        for origin in (o.strip() for o in value.split(",") if o.strip()):
            if origin != "*" and not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?", origin):
                raise ValueError(f"{origin!r} is not an origin such as https://app.example.com")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        """Only the standard logging levels."""
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
        return value.upper()

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        """Cross-field checks that would otherwise fail much later."""
        if self.heartbeat_interval_s >= self.lease_s:
            raise ValueError(
                f"GPUJOBS_HEARTBEAT_INTERVAL_S ({self.heartbeat_interval_s:g}) must be shorter than "
                f"GPUJOBS_LEASE_S ({self.lease_s:g})"
            )
        if self.priority_min > self.priority_max:
            raise ValueError(
                f"GPUJOBS_PRIORITY_MIN ({self.priority_min}) must not exceed "
                f"GPUJOBS_PRIORITY_MAX ({self.priority_max})"
            )
        self._default_priority_allowed()
        return self

    def _default_priority_allowed(self) -> None:
        """The range must hold the priority of a job that asks for none, or every such upload (the
        README's curl, `submit` without --priority, the web form) is refused over a field not sent."""
        if self.priority_min > DEFAULT_PRIORITY:
            raise ValueError(
                f"GPUJOBS_PRIORITY_MIN ({self.priority_min}) must be at most {DEFAULT_PRIORITY}, "
                "the priority of a job that asks for none"
            )
        if self.priority_max < DEFAULT_PRIORITY:
            raise ValueError(
                f"GPUJOBS_PRIORITY_MAX ({self.priority_max}) must be at least {DEFAULT_PRIORITY}, "
                "the priority of a job that asks for none"
            )

    @property
    def max_upload_bytes(self) -> int:
        """The upload limit in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def dead_worker_after_s(self) -> float:
        """How long a worker may go without a heartbeat before it counts as dead (as the reaper judges)."""
        return max(self.lease_s, 3 * self.heartbeat_interval_s)

    @property
    def cors_origin_list(self) -> list[str]:
        """The allowed CORS origins."""
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def worker_id(self) -> str:
        """Stable worker identity: host and name."""
        host = socket.gethostname()
        return f"{host}:{self.worker_name or 'worker'}"


def load_settings(**overrides: object) -> Settings:
    """Build Settings, turning validation errors into one message that names each bad setting."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            # A validator's own message, without pydantic's "Value error, " in front of it.
            message = str(err["ctx"]["error"]) if "error" in err.get("ctx", {}) else err["msg"]
            if not err["loc"]:  # a check across settings: its message names the variables
                problems.append(message)
                continue
            env = "GPUJOBS_" + ".".join(str(part) for part in err["loc"]).upper()
            problems.append(message if message.startswith(f"{env}:") else f"{env}: {message}")
        raise errors.ConfigError("invalid configuration: " + "; ".join(problems)) from exc


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings (cached; call only from cli.py and api/)."""
    return load_settings()


def markdown_table() -> str:
    """The configuration table of the README, made from the fields above."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default
        if default is None:
            shown = "unset"
        elif isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, Path) and default.is_relative_to(checkout.ROOT):
            shown = f"{default.relative_to(checkout.ROOT)} (in the checkout)"  # no path of this machine
        else:
            shown = str(default)
        rows.append(f"| `GPUJOBS_{name.upper()}` | `{shown}` | {field.description or ''} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
