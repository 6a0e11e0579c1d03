"""Finding a worker's leftover runs on this host by the markers in their environment."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from app.queue import leftovers


@pytest.fixture
def sleepers() -> Iterator[dict[str, int]]:
    """Processes (own sessions) marked as a one-shot run of `h:w10` and a warm runner of `h:w2`."""
    marks = {"run": {"GPUJOBS_WORKER": "h:w10"}, "runner": {"GPUJOBS_RUNNER": "h:w2:relief:0"}}
    path = {"PATH": os.environ["PATH"]}
    started = {
        name: subprocess.Popen(["sleep", "30"], env={**path, **env}, start_new_session=True)
        for name, env in marks.items()
    }
    yield {name: p.pid for name, p in started.items()}
    for p in started.values():
        p.kill()
        p.wait()


def test_a_workers_runs_and_runners_are_found_by_its_exact_id(sleepers):
    assert sleepers["run"] in leftovers.find_worker_models("h:w10")
    assert sleepers["runner"] in leftovers.find_worker_models("h:w2")
    found = leftovers.find_worker_models("h:w1")  # a prefix of both ids: neither is its run
    assert sleepers["run"] not in found and sleepers["runner"] not in found
