"""The operator's commands as the README and docs/operations.md describe them, run as real processes."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.conftest import free_port, wait_until_serving, worker_env


def test_serve_runs_no_worker_when_the_setting_says_so(settings, tmp_path):
    """GPUJOBS_RUN_WORKER=false is documented as turning off `serve`'s in-process worker; the
    `--worker/--no-worker` flag's default overrode it, so a worker ran (and claimed jobs) anyway."""
    port = free_port()
    env = worker_env(settings, "no-worker", run_worker="false")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", str(port)], env=env, stdout=out, stderr=out
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_serving(serve, base, log)
        ready = httpx.get(f"{base}/readyz", timeout=10).json()
        assert ready["workers"] == 0, (ready, log.read_text())
    finally:
        serve.terminate()
        serve.wait(timeout=30)
