"""A worker's configuration: how long its leases, heartbeats and graces are, what it claims."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.queue import planner as planner_
from app.queue import site


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How a worker behaves; built from Settings by the CLI and the API."""

    worker_id: str
    lease_s: float = 20.0
    heartbeat_interval_s: float = 5.0
    poll_interval_s: float = 2.0
    claim_gather_s: float = 0.001  # after a job ends while others run: wait this long, then claim once
    # With max_jobs_per_gpu: models whose runs take less than this get their next jobs claimed ahead.
    claim_ahead_s: float = 0.05
    reap_interval_s: float = 5.0
    kill_grace_s: float = 5.0
    shutdown_grace_s: float = 30.0
    max_log_mb: float = 16.0  # each log file: a job's keeps its head and last lines, a runner's rotates
    retry_base_s: float = 5.0
    retry_max_s: float = 600.0
    python: str = "python3"
    burst: bool = False  # tests: exit once nothing is queued that fits and nothing runs
    age_step_s: float = 60.0
    age_max_boost: int = 10
    oom_max_retries: int = 2
    oom_growth: float = 1.5
    warm_idle_s: float = 300.0  # a warm runner with no job for this long is stopped
    warm_paced: bool = False  # jobs wait for a busy runner unless one more would serve them sooner
    # What may be claimed and where: VRAM buffer, jobs per GPU, reservations, batches (the planner's).
    scheduling: planner_.PlannerConfig = field(default_factory=planner_.PlannerConfig)

    @property
    def max_log_bytes(self) -> int:
        """The cap on each log file in bytes (0: none)."""
        return int(self.max_log_mb * 1024 * 1024)

    def attempt_config(self) -> site.AttemptConfig:
        """The settings of this worker's attempts."""
        return site.AttemptConfig(
            self.worker_id,
            self.kill_grace_s,
            self.retry_base_s,
            self.retry_max_s,
            self.python,
            oom_max_retries=self.oom_max_retries,
            oom_growth=self.oom_growth,
            max_log_bytes=self.max_log_bytes,
        )
