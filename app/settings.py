"""Settings: every knob of the service, read from `GPUJOBS_*` environment variables.

Only `cli.py` and `api/` call `get_settings()`; everything else takes plain arguments.
"""

from __future__ import annotations

import functools
import socket
from pathlib import Path

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app import errors


class Settings(BaseSettings):
    """The service's configuration. Field docs are the README's configuration table."""

    model_config = SettingsConfigDict(env_prefix="GPUJOBS_", env_file=None, extra="ignore")

    database_url: str | None = Field(
        None, description="PostgreSQL URL; unset = embedded PostgreSQL in <storage_dir>/pgdata"
    )
    storage_dir: Path = Field(Path("storage"), description="Result files, logs, scratch, embedded database")
    host: str = Field("127.0.0.1", description="Address the API binds to")
    port: int = Field(8000, ge=1, le=65535, description="Port the API binds to")
    max_upload_mb: float = Field(20, gt=0, le=4096, description="Largest accepted upload, in MB")
    max_image_megapixels: float = Field(
        64, gt=0, le=1000, description="Largest accepted image, in megapixels (decompression bombs)"
    )
    queue_limit: int = Field(10_000, ge=1, description="Most queued jobs; POST /jobs answers 429 when full")
    priority_min: int = Field(-100, description="Lowest priority a job may ask for")
    priority_max: int = Field(100, description="Highest priority a job may ask for")
    lease_s: float = Field(20, gt=0, description="How long a claimed job's lease lasts without a heartbeat")
    heartbeat_interval_s: float = Field(5, gt=0, description="How often a worker renews its leases")
    poll_interval_s: float = Field(2, gt=0, description="Claim poll when no NOTIFY arrives (fallback)")
    reap_interval_s: float = Field(5, gt=0, description="How often a worker looks for expired leases")
    worker_name: str = Field("", description="Worker identity on this host (default: the host name)")
    run_worker: bool = Field(True, description="`gpujobs serve` also runs a worker in the same process")
    gpus: str | None = Field(None, description='Virtual GPUs when NVML is absent, e.g. "24GiB,24GiB"')
    virtual_gpu_mb: int = Field(24_576, gt=0, description="Size of the one virtual GPU when gpus is unset")
    vram_buffer_mb: int = Field(512, ge=0, description="VRAM kept free on every GPU")
    max_jobs_per_gpu: int = Field(0, ge=0, description="Cap on concurrent jobs per GPU (0 = only VRAM)")
    models_file: Path | None = Field(None, description="Extra model registry TOML file")
    link_secret: str | None = Field(
        None, description="HMAC secret for download links; unset = generated once in storage_dir"
    )
    link_ttl_s: int = Field(3600, gt=0, description="How long a download link stays valid")
    kill_grace_s: float = Field(5, ge=0, description="Seconds between SIGTERM and SIGKILL of a model")
    shutdown_grace_s: float = Field(30, ge=0, description="On SIGTERM, how long running jobs may finish")
    retry_base_s: float = Field(5, ge=0, description="First retry delay; doubles each attempt (jitter)")
    retry_max_s: float = Field(600, ge=0, description="Longest retry delay")
    log_level: str = Field("INFO", description="Log level")

    @field_validator("database_url")
    @classmethod
    def _asyncpg_driver(cls, value: str | None) -> str | None:
        """Accept postgres:// and postgresql:// URLs, always use asyncpg."""
        if value is None or value == "":
            return None
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in {"postgres", "postgresql", "postgresql+asyncpg"}:
            raise ValueError("must be a postgresql:// URL")
        return f"postgresql+asyncpg://{rest}"

    @field_validator("gpus")
    @classmethod
    def _gpu_sizes(cls, value: str | None) -> str | None:
        """Reject an unreadable GPU list at start, not at the first claim."""
        if value:
            from app import gpu

            try:
                gpu.parse_sizes(value)
            except errors.ConfigError as exc:
                raise ValueError(exc.message) from exc
        return value or None

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
            raise ValueError("heartbeat_interval_s must be shorter than lease_s")
        if self.priority_min > self.priority_max:
            raise ValueError("priority_min must not exceed priority_max")
        return self

    @property
    def max_upload_bytes(self) -> int:
        """The upload limit in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)

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
            name = ".".join(str(part) for part in err["loc"]) or "settings"
            env = f"GPUJOBS_{name.upper()}" if err["loc"] else "settings"
            problems.append(f"{env}: {err['msg']}")
        raise errors.ConfigError("invalid configuration: " + "; ".join(problems)) from exc


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings (cached; call only from cli.py and api/)."""
    return load_settings()
