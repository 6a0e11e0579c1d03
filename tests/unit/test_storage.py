"""ResultStore's scratch space: one flat folder per attempt, made and swept in few calls."""

from __future__ import annotations

import uuid
from pathlib import Path

from app import storage


def test_prepare_makes_the_scratch_folder_input_and_log_folder(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    job = uuid.uuid4()
    scratch, log = store.prepare(job, 2, "input.png", b"\x89PNG data")
    assert scratch == tmp_path / "scratch" / f"{job}.2"
    assert (scratch / "input.png").read_bytes() == b"\x89PNG data"
    assert (scratch / "out").is_dir() and not any((scratch / "out").iterdir())
    assert log == tmp_path / "logs" / str(job) / "attempt-2.log" and log.parent.is_dir()
    assert store.scratch_attempts() == [(job, 2)]


def test_a_folder_left_by_an_earlier_life_is_started_afresh(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    job = uuid.uuid4()
    scratch, _ = store.prepare(job, 1, "input.png", b"old")
    (scratch / "out" / "half.glb").write_bytes(b"half")
    scratch, _ = store.prepare(job, 1, "input.png", b"new")
    assert (scratch / "input.png").read_bytes() == b"new" and not any((scratch / "out").iterdir())


def test_sweep_removes_dead_attempts_only_and_ignores_strangers(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    alive, dead = uuid.uuid4(), uuid.uuid4()
    store.prepare(alive, 1, "input.png", b"a")
    store.prepare(dead, 3, "input.png", b"d")
    (tmp_path / "scratch" / "not-a-job").mkdir()
    assert sorted(store.scratch_attempts()) == sorted([(alive, 1), (dead, 3)])
    assert store.sweep(store.scratch_attempts(), [(alive, 1)]) == 1
    assert store.scratch_attempts() == [(alive, 1)]
    store.drop_scratch(alive, 1)
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["not-a-job"]
