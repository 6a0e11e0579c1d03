"""What a killed worker left in its lanes is removed by another worker's sweep, and only that.

The workers here are real processes holding their locks (`Lanes.hold`); one is killed with SIGKILL,
as a crash or the OOM killer would.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import presence, storage

HOLDER = """
import sys, time
from pathlib import Path
from app import storage
store = storage.ResultStore(Path(sys.argv[1]))
worker = sys.argv[2]
assert store.lanes.hold(worker)
store.lanes.prepare(store.lanes.path(worker, 0), "input.png", b"a user's image")
store.runner_temp(store.runner_dir("toy", 0), worker)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Worker processes by id, each holding its lanes, with an input in a lane and a runner's
    temporary folder; all are killed at the end."""
    started: dict[str, subprocess.Popen[str]] = {}
    for worker in ("host:a", "host:b"):
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path / "storage"), worker],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None and process.stdout.readline() == "holding\n"
        started[worker] = process
    yield started
    for process in started.values():
        process.kill()
        process.wait()
        process.stdout.close()  # type: ignore[union-attr]


def runner_temps(store: storage.ResultStore, worker: str) -> list[Path]:
    return list((store.root / "runners").glob(f"*/{storage._temp_prefix(worker)}*"))


def test_a_killed_workers_lanes_and_runner_folders_are_swept_and_the_living_are_kept(tmp_path, workers):
    store = storage.ResultStore(tmp_path / "storage")
    unlocked = store.lanes.path("host:old-version", 0)  # a worker of before the locks: maybe running
    unlocked.mkdir(parents=True)
    assert store.lanes.sweep(store.drop_runner_temps) == []
    assert store.lanes.path("host:a", 0).joinpath("input.png").read_bytes() == b"a user's image"

    workers["host:a"].send_signal(signal.SIGKILL)
    workers["host:a"].wait()
    assert store.lanes.sweep(store.drop_runner_temps) == ["host:a"]
    assert not store.lanes.folder("host:a").exists() and runner_temps(store, "host:a") == []
    assert not (store.lanes.scratch / "host_a.lock").exists()
    assert store.lanes.path("host:b", 0).joinpath("input.png").is_file() and runner_temps(store, "host:b")
    assert unlocked.is_dir()
    assert store.lanes.sweep(store.drop_runner_temps) == []


def test_a_worker_that_stops_leaves_neither_lanes_nor_lock(tmp_path):
    store = storage.ResultStore(tmp_path / "storage")
    assert store.lanes.hold("host:a")
    store.lanes.prepare(store.lanes.path("host:a", 0), "input.png", b"image")
    assert store.lanes.sweep(store.drop_runner_temps) == []  # its own lock is held: not swept
    store.lanes.leave("host:a")
    assert list(store.lanes.scratch.iterdir()) == []


def test_a_second_holder_of_one_id_does_not_get_the_lock(tmp_path):
    store = storage.ResultStore(tmp_path / "storage")
    assert store.lanes.hold("host:a")
    twin = presence.Presence(store.lanes.folder("host:a"), "host:a")
    assert not twin.take(wait_s=0.2)
    store.lanes.leave("host:a")
    assert twin.take(wait_s=0.2)
    twin.leave()


def test_a_lock_file_not_yet_written_is_left_to_the_worker_taking_it(tmp_path):
    store = storage.ResultStore(tmp_path / "storage")
    (store.lanes.scratch / "host_a.lock").touch()
    store.lanes.path("host:a", 0).mkdir(parents=True)
    assert store.lanes.sweep(store.drop_runner_temps) == []
    assert store.lanes.path("host:a", 0).is_dir()


def test_a_worker_starting_while_its_old_lanes_are_swept_waits_and_then_holds_a_lock_of_its_own(tmp_path):
    """The sweep removes the lock file it holds; the worker that waited for it must not hold that
    removed file (no other process could tell it is alive): it takes the lock on a new one."""
    store = storage.ResultStore(tmp_path / "storage")
    (store.lanes.scratch / "host_a.lock").write_text("host:a")  # left by a killed life
    store.lanes.path("host:a", 0).mkdir(parents=True)
    sweeping, go_on = threading.Event(), threading.Event()

    def slow_removal(_worker: str) -> None:
        sweeping.set()
        assert go_on.wait(10)

    swept: list[str] = []
    sweep = threading.Thread(target=lambda: swept.extend(store.lanes.sweep(slow_removal)))
    sweep.start()
    assert sweeping.wait(10)
    held: list[bool] = []
    start = threading.Thread(target=lambda: held.append(store.lanes.hold("host:a")))
    start.start()
    start.join(0.3)
    assert start.is_alive()  # waits for the sweep
    go_on.set()
    sweep.join(10)
    start.join(10)
    assert swept == ["host:a"] and held == [True]
    assert (store.lanes.scratch / "host_a.lock").read_text() == "host:a"
    assert store.lanes.sweep(store.drop_runner_temps) == []  # held: the new lock file is this worker's
    store.lanes.leave("host:a")
