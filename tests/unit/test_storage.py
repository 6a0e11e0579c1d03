"""ResultStore's scratch lanes: folders made once per worker slot, emptied between jobs."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from app import storage


def test_prepare_puts_the_input_in_the_lane_and_makes_the_log_folder(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    lane, job = store.lane_dir("host:w1", 0), uuid.uuid4()
    assert lane == tmp_path / "scratch" / "host_w1" / "0"
    log = store.prepare(lane, "input.png", b"\x89PNG data", job, 2)
    assert (lane / "input.png").read_bytes() == b"\x89PNG data"
    assert (lane / "out").is_dir() and not any((lane / "out").iterdir())
    assert log == tmp_path / "logs" / str(job) / "attempt-2.log" and log.parent.is_dir()


def test_clearing_a_lane_leaves_only_an_empty_out_folder(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    lane = store.lane_dir("w", 0)
    store.prepare(lane, "input.png", b"first", uuid.uuid4(), 1)
    (lane / ".cache" / "deep").mkdir(parents=True)
    (lane / ".cache" / "deep" / "secret").write_text("first job's")
    (lane / "out" / "mesh.glb").write_bytes(b"unpublished")
    (lane / "out" / "sub").mkdir()
    assert store.clear_lane(lane)
    assert sorted(os.listdir(lane)) == ["out"] and os.listdir(lane / "out") == []
    store.prepare(lane, "input.jpg", b"second", uuid.uuid4(), 1)
    assert sorted(os.listdir(lane)) == ["input.jpg", "out"]


def test_an_out_folder_replaced_by_a_link_is_removed_not_followed(tmp_path: Path):
    store = storage.ResultStore(tmp_path / "storage")
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "keep.txt").write_text("not the worker's to delete")
    lane = store.lane_dir("w", 0)
    store.prepare(lane, "input.png", b"x", uuid.uuid4(), 1)
    os.rmdir(lane / "out")
    os.symlink(victim, lane / "out")
    assert store.clear_lane(lane)
    assert (victim / "keep.txt").exists()
    assert (lane / "out").is_dir() and not (lane / "out").is_symlink()


def test_reset_removes_only_the_owners_lanes(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    mine, theirs = store.lane_dir("w1", 0), store.lane_dir("w2", 0)
    for lane in (mine, theirs):
        store.prepare(lane, "input.png", b"x", uuid.uuid4(), 1)
    store.reset_lanes("w1")
    assert not mine.exists() and (theirs / "input.png").exists()
    store.prepare(mine, "input.png", b"y", uuid.uuid4(), 1)  # made again after a reset
    assert (mine / "out").is_dir()
