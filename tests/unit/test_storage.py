"""ResultStore's scratch lanes: folders made once per worker slot, emptied between jobs."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from app import storage


def test_prepare_puts_the_input_in_the_lane_and_makes_nothing_for_the_log(tmp_path: Path):
    # The log and its bucket folder are made by the model's first byte (app/runlog.py): a quiet
    # job makes neither, and a fresh storage pays no 256 folder creations up front.
    store = storage.ResultStore(tmp_path)
    lane, job = store.lanes.path("host:w1", 0), uuid.uuid4()
    assert lane == tmp_path / "scratch" / "host_w1" / "0"
    store.lanes.prepare(lane, "input.png", b"\x89PNG data")
    assert (lane / "input.png").read_bytes() == b"\x89PNG data"
    assert (lane / "out").is_dir() and not any((lane / "out").iterdir())
    log = store.log_path(job, 2)
    assert log == tmp_path / "logs" / job.hex[:2] / f"{job}.attempt-2.log"
    assert not log.parent.exists()


def test_clearing_a_lane_leaves_its_input_file_and_an_empty_out_folder(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    lane = store.lanes.path("w", 0)
    store.lanes.prepare(lane, "input.png", b"first")
    (lane / ".cache" / "deep").mkdir(parents=True)
    (lane / ".cache" / "deep" / "secret").write_text("first job's")
    (lane / "out" / "mesh.glb").write_bytes(b"unpublished")
    (lane / "out" / "sub").mkdir()
    assert store.lanes.clear(lane)
    assert sorted(os.listdir(lane)) == ["input.png", "out"] and os.listdir(lane / "out") == []
    store.lanes.prepare(lane, "input.jpg", b"second")  # the kept input, overwritten
    assert sorted(os.listdir(lane)) == ["input.jpg", "out"]
    assert (lane / "input.jpg").read_bytes() == b"second"


def test_jobs_in_a_lane_reuse_one_input_file(tmp_path: Path):
    """No file is made or freed per job: on ext4 without a journal, every freed inode made each
    later file creation slower (it skips recently freed inodes one at a time)."""
    store = storage.ResultStore(tmp_path)
    lane = store.lanes.path("w", 0)
    store.lanes.prepare(lane, "input.png", b"the first input, the longest")
    fd = os.open(lane / "input.png", os.O_RDONLY)  # the file itself, whatever its name
    try:
        for name, data in (("input.png", b"two"), ("input.jpg", b"three"), ("input.png", b"four")):
            assert store.lanes.clear(lane)
            store.lanes.prepare(lane, name, data)
            assert os.fstat(fd).st_nlink == 1 and os.pread(fd, 100, 0) == data  # never removed
            assert sorted(os.listdir(lane)) == [name, "out"]
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["input.png", "input.jpg"])
def test_a_lane_removed_since_it_was_made_is_made_again(tmp_path: Path, name: str):
    """The storage folder cleaned by hand while the worker ran: each lane it had made failed its
    next job ("could not prepare the scratch folder: No such file or directory"), an attempt spent."""
    store = storage.ResultStore(tmp_path / "storage")
    lane = store.lanes.path("w", 0)
    store.lanes.prepare(lane, "input.png", b"first")
    assert store.lanes.clear(lane)
    shutil.rmtree(tmp_path / "storage")
    store.lanes.prepare(lane, name, b"second")
    assert sorted(os.listdir(lane)) == [name, "out"] and (lane / name).read_bytes() == b"second"


def test_an_input_the_model_made_read_only_is_made_anew(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    lane = store.lanes.path("w", 0)
    store.lanes.prepare(lane, "input.png", b"first")
    (lane / "input.png").chmod(0o400)  # as a non-root worker, the next write would be refused
    assert store.lanes.clear(lane) and sorted(os.listdir(lane)) == ["out"]
    store.lanes.prepare(lane, "input.png", b"second")
    assert (lane / "input.png").read_bytes() == b"second"
    assert (lane / "input.png").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("replace", ["symlink", "hardlink", "folder", "fifo"])
def test_an_input_the_model_replaced_is_removed_and_what_it_points_to_is_untouched(
    tmp_path: Path, replace: str
):
    store = storage.ResultStore(tmp_path / "storage")
    lane, victim = store.lanes.path("w", 0), tmp_path / "victim"
    victim.write_bytes(b"not the worker's")
    store.lanes.prepare(lane, "input.png", b"x")
    (lane / "input.png").unlink()
    if replace == "symlink":
        os.symlink(victim, lane / "input.png")
    elif replace == "hardlink":
        os.link(victim, lane / "input.png")
    elif replace == "folder":
        (lane / "input.png").mkdir()
        (lane / "input.png" / "inner").write_bytes(b"y")
    else:
        os.mkfifo(lane / "input.png")
    assert store.lanes.clear(lane)
    assert sorted(os.listdir(lane)) == ["out"]
    assert victim.read_bytes() == b"not the worker's"
    store.lanes.prepare(lane, "input.png", b"next")
    assert (lane / "input.png").read_bytes() == b"next" and victim.read_bytes() == b"not the worker's"


def test_an_out_folder_replaced_by_a_link_is_removed_not_followed(tmp_path: Path):
    store = storage.ResultStore(tmp_path / "storage")
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "keep.txt").write_text("not the worker's to delete")
    lane = store.lanes.path("w", 0)
    store.lanes.prepare(lane, "input.png", b"x")
    os.rmdir(lane / "out")
    os.symlink(victim, lane / "out")
    assert store.lanes.clear(lane)
    assert (victim / "keep.txt").exists()
    assert (lane / "out").is_dir() and not (lane / "out").is_symlink()


def test_reset_removes_only_the_owners_lanes(tmp_path: Path):
    store = storage.ResultStore(tmp_path)
    mine, theirs = store.lanes.path("w1", 0), store.lanes.path("w2", 0)
    for lane in (mine, theirs):
        store.lanes.prepare(lane, "input.png", b"x")
    store.lanes.reset("w1")
    assert not mine.exists() and (theirs / "input.png").exists()
    store.lanes.prepare(mine, "input.png", b"y")  # made again after a reset
    assert (mine / "out").is_dir()


def test_outputs_behind_an_out_folder_replaced_by_a_link_are_refused_and_left_in_place(tmp_path: Path):
    """The model swaps its `out/` for a link to a folder elsewhere that holds a file of the output's
    name. Each output was checked not to be a link itself, but `out/` was followed: the file was
    taken as the job's result, and publishing moved it out of the folder it belongs to."""
    store = storage.ResultStore(tmp_path / "storage")
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "mesh.glb").write_bytes(b"not the model's output")
    lane = store.lanes.path("w", 0)
    store.lanes.prepare(lane, "input.png", b"x")
    os.rmdir(lane / "out")
    os.symlink(victim, lane / "out")
    with pytest.raises(storage.OutputInvalid, match="not a folder"):
        store.stage(uuid.uuid4(), 1, lane / "out", [storage.ExpectedOutput("mesh.glb", "model/gltf-binary")])
    assert (victim / "mesh.glb").read_bytes() == b"not the model's output"


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda out, kept: os.symlink(kept, out), "is a symbolic link, not a file"),
        (lambda out, kept: os.mkdir(out), "is a folder, not a file"),
        (lambda out, kept: os.mkfifo(out), "is not a regular file"),
        (lambda out, kept: os.link(kept, out), "is a hard link (the file has 2 names)"),
    ],
    ids=["symlink", "folder", "fifo", "hardlink"],
)
def test_an_output_that_is_no_file_of_the_runs_own_is_refused_and_said_so(tmp_path: Path, make, said):
    """A link said "was not written", and a hard link to a file a warm runner keeps was published:
    the runner could change the file served after its sha256 was recorded. The file it names is
    left alone."""
    store = storage.ResultStore(tmp_path / "storage")
    kept = tmp_path / "kept.glb"
    kept.write_bytes(b"the runner's own file")
    lane = store.lanes.path("w", 0)
    store.lanes.prepare(lane, "input.png", b"x")
    make(lane / "out" / "mesh.glb", kept)
    with pytest.raises(storage.OutputInvalid, match=re.escape(f"output 'mesh.glb' {said}")):
        store.stage(uuid.uuid4(), 1, lane / "out", [storage.ExpectedOutput("mesh.glb", "model/gltf-binary")])
    assert kept.read_bytes() == b"the runner's own file" and os.stat(kept).st_nlink == 1


def test_outputs_are_hashed_where_no_writer_by_the_lanes_path_reaches_them(tmp_path: Path):
    """The outputs were checked and hashed in the lane's out/, then moved at publishing: a process
    the run left behind, writing by path, replaced one between its hash and its publishing, and
    the file served did not match its recorded sha256. They are now moved into the attempt's
    staging folder first (a rename each), then checked and hashed there; optional outputs the
    model did not write leave no staging folder behind, nor do refused ones."""
    store = storage.ResultStore(tmp_path)
    lane, job = store.lanes.path("w", 0), uuid.uuid4()
    store.lanes.prepare(lane, "input.png", b"x")
    (lane / "out" / "mesh.glb").write_bytes(b"the run's own")
    expected = [
        storage.ExpectedOutput("mesh.glb", "model/gltf-binary"),
        storage.ExpectedOutput("a.png", "image/png", False),
    ]
    [found] = store.stage(job, 1, lane / "out", expected)
    (lane / "out" / "mesh.glb").write_bytes(
        b"a leftover's, by path"
    )  # after the move: reaches nothing staged
    [described] = storage.hash_outputs([found])
    final = store.publish(job, 1, [described])
    served = (final / "mesh.glb").read_bytes()
    assert served == b"the run's own" and described.sha256 == hashlib.sha256(served).hexdigest()
    assert store.stage(job, 2, lane / "out", expected[1:]) == []
    (lane / "out" / "empty.glb").write_bytes(b"")
    with pytest.raises(storage.OutputInvalid, match="empty"):
        store.stage(job, 3, lane / "out", [storage.ExpectedOutput("empty.glb", "model/gltf-binary")])
    assert sorted(os.listdir(final.parent)) == ["1"]


def test_published_results_are_on_disk_before_the_success_is_written(tmp_path: Path, monkeypatch):
    """The success names the files, with their sizes and digests, in the database; a host that
    crashed after it must not come back with those files empty or missing. So the files, the
    attempt's folder and the job's folder are flushed (fsync) before publish returns, the folders
    holding the renamed attempt after its rename (flushed before, the rename itself may be lost)."""
    synced: set[int] = set()
    steps: list[tuple[str, int]] = []  # ("fsync", inode) and ("rename", inode of the target's folder)
    fsync, replace = os.fsync, os.replace

    def recording(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        steps.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def renaming(src: Any, dst: Any) -> None:
        replace(src, dst)
        steps.append(("rename", Path(dst).parent.stat().st_ino))

    monkeypatch.setattr(os, "fsync", recording)
    monkeypatch.setattr(os, "replace", renaming)
    store = storage.ResultStore(tmp_path)
    lane, job = store.lanes.path("w", 0), uuid.uuid4()
    store.lanes.prepare(lane, "input.png", b"x")
    (lane / "out" / "mesh.glb").write_bytes(b"glTF")
    found = store.stage(job, 1, lane / "out", [storage.ExpectedOutput("mesh.glb", "model/gltf-binary")])
    files = storage.hash_outputs(found)
    final = store.publish(job, 1, files)
    assert (final / "mesh.glb").read_bytes() == b"glTF"
    wanted = {final / "mesh.glb", final, final.parent, final.parent.parent}
    assert {p.stat().st_ino for p in wanted} <= synced
    job_folder, results = final.parent.stat().st_ino, final.parent.parent.stat().st_ino
    last_rename = max(i for i, step in enumerate(steps) if step == ("rename", job_folder))
    assert ("fsync", job_folder) in steps[last_rename:] and ("fsync", results) in steps[last_rename:]


# A model's read-only leftovers in its lane: a folder of assets it copied (mode 0555), one it shut
# (0000), a read-only `out/`. Then the lane is emptied for the next job, and the worker's lanes are
# removed at its stop. Prints what is left.
READ_ONLY_LEFTOVERS = """
import os, sys
from pathlib import Path
from app import storage
store = storage.ResultStore(Path(sys.argv[1]))
lane = store.lanes.path("w", 0)
store.lanes.prepare(lane, "input.png", b"x")
for folder, mode in ((lane / "out" / "textures", 0o555), (lane / "cache" / "deep", 0o000)):
    folder.mkdir(parents=True)
    (folder / "t.png").write_bytes(b"x")
    folder.chmod(mode)
(lane / "out" / "mesh.glb").write_bytes(b"x")
(lane / "out").chmod(0o555)
print("emptied" if store.lanes.clear(lane) else "dropped", sorted(p.name for p in lane.iterdir()))
store.lanes.reset("w")
print("removed" if not (store.root / "scratch" / "w").exists() else "left")
"""


def run_without_overriding_permissions(script: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` with the storage root `root` as its argument, where file modes apply: as root,
    under setpriv with CAP_DAC_OVERRIDE and its like taken away (skipped without setpriv)."""
    argv = [sys.executable, "-c", script, str(root)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permissions would not apply")
        argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", *argv]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": os.environ["PATH"]}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done


def test_read_only_folders_a_model_leaves_in_its_lane_are_removed(tmp_path: Path):
    """A lane holding a folder its model made read-only could not be emptied: the lane was dropped
    (a new one made for the next job), and at the worker's stop the folder stayed for good, found
    again, and dropped again, by every start. (Run without the power to ignore permissions: as
    root, with CAP_DAC_OVERRIDE and its like taken away.)"""
    done = run_without_overriding_permissions(READ_ONLY_LEFTOVERS, tmp_path / "storage")
    assert done.stdout.split("\n")[:2] == ["emptied ['input.png', 'out']", "removed"], done.stdout


# Files under storage/ that the API's user cannot read: a result folder, a log bucket folder and a
# result file, each shut (mode 0000: even their owner, without the power to ignore permissions).
# Prints how each download is answered.
UNREADABLE_DOWNLOADS = """
import dataclasses, os, sys, uuid
from pathlib import Path
from app import errors, storage
from app.queue import jobs
store = storage.ResultStore(Path(sys.argv[1]))
blank = {f.name: None for f in dataclasses.fields(jobs.Job)}
result = {"name": "mesh.glb", "bytes": 4, "sha256": "0" * 64, "media_type": "model/gltf-binary"}
for shut in ("folder", "log folder", "file"):
    row = {"id": uuid.uuid4(), "state": "succeeded", "attempt": 1, "results": [result]}
    job = jobs.Job.from_row(blank | row)
    folder = store.root / "results" / str(job.id) / "1"
    folder.mkdir(parents=True)
    (folder / "mesh.glb").write_bytes(b"glTF")
    log = store.log_path(job.id, 1)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("printed")
    target = {"folder": folder.parent, "log folder": log.parent, "file": folder / "mesh.glb"}[shut]
    target.chmod(0)
    for name in ("mesh.glb", "attempt-1.log"):
        try:
            found = store.open(job, name)
            print(shut, name, "opened" if found.file else "empty")
        except errors.AppError as exc:
            print(shut, name, type(exc).__name__, exc.message.replace(str(job.id), "<id>"))
    target.chmod(0o700)
"""


def test_files_the_api_cannot_read_are_a_storage_error_not_missing_or_empty(tmp_path: Path):
    """A result folder the API's user may not enter was a PermissionError (a 500 with a
    traceback); a log folder likewise, an empty log (200); a result file it may not read, "not on
    disk" (404). Now a StorageError that names the path under storage/ and says the API's user
    cannot read it. (Run without the power to ignore permissions: as root, with CAP_DAC_OVERRIDE
    and its like taken away.)"""
    done = run_without_overriding_permissions(UNREADABLE_DOWNLOADS, tmp_path / "storage")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("folder mesh.glb StorageError "), lines
    assert lines[1] == "folder attempt-1.log opened", lines
    assert lines[2] == "log folder mesh.glb opened", lines
    assert lines[3].startswith("log folder attempt-1.log StorageError "), lines
    assert lines[4].startswith("file mesh.glb StorageError "), lines
    assert lines[5] == "file attempt-1.log opened", lines
    for line, path in zip(
        (lines[0], lines[3], lines[4]),
        ("results/<id>/1/mesh.glb", "logs/", "results/<id>/1/mesh.glb"),
        strict=True,
    ):
        assert f"storage/{path}" in line and "the API's user cannot read" in line, line


@pytest.mark.parametrize("part", ["scratch", "results", "logs"])
def test_a_file_in_the_way_of_a_folder_names_the_setting(tmp_path: Path, part: str):
    """A file where a storage folder goes was a FileExistsError deep in the start-up."""
    from app import errors

    (tmp_path / part).write_text("a file")
    with pytest.raises(errors.ConfigError) as refused:
        storage.ResultStore(tmp_path)
    assert refused.value.message == f"GPUJOBS_STORAGE_DIR: cannot use {tmp_path / part}: not a folder"


@pytest.mark.parametrize("part", ["scratch", "results", "logs"])
def test_a_part_may_be_a_link_to_another_disk_but_not_to_nothing(tmp_path: Path, part: str):
    """A part linked to a folder elsewhere (results on a bigger disk) is used through its real
    path, read at start (publish's O_NOFOLLOW fsync failed on `results`, and every download was
    refused as "not on disk"); a link to no folder names the link and what to do."""
    from app import errors

    (tmp_path / "root").mkdir()
    (tmp_path / "root" / part).symlink_to(tmp_path / "big-disk")
    with pytest.raises(errors.ConfigError) as refused:
        storage.ResultStore(tmp_path / "root")
    assert refused.value.message == (
        f"GPUJOBS_STORAGE_DIR: cannot use {tmp_path / 'root' / part}: a link to {tmp_path / 'big-disk'}, "
        "which is not a folder: make that folder, or replace the link"
    )
    (tmp_path / "big-disk").mkdir()
    store = storage.ResultStore(tmp_path / "root")
    store.probe("w1")
    assert store.lanes.folder("w1").is_relative_to(tmp_path / "big-disk") is (part == "scratch")
    assert store.log_path(uuid.uuid4(), 1).is_relative_to(tmp_path / "big-disk") is (part == "logs")


def test_a_folder_in_the_way_of_the_link_secret_names_the_setting(tmp_path: Path):
    """A folder named `link_secret` was an IsADirectoryError in the start-up."""
    from app import errors, links

    (tmp_path / "link_secret").mkdir()
    with pytest.raises(errors.ConfigError) as refused:
        links.load_or_create_secret(tmp_path)
    assert refused.value.message.startswith(f"GPUJOBS_STORAGE_DIR: cannot use {tmp_path / 'link_secret'}: ")


def test_a_new_link_secret_is_on_disk_before_it_is_linked_into_place(tmp_path: Path, monkeypatch):
    """The secret was linked into place unflushed: a host that lost power soon after could come
    back with `link_secret` empty, and the service refused to start until it was deleted (and a
    new secret broke the links signed since)."""
    from app import links

    steps: list[str] = []
    fsync, link = os.fsync, os.link

    def syncing(fd: int) -> None:
        steps.append("fsync file" if os.path.isfile(f"/proc/self/fd/{fd}") else "fsync folder")
        fsync(fd)

    def linking(src: Any, dst: Any) -> None:
        steps.append("link")
        link(src, dst)

    monkeypatch.setattr(os, "fsync", syncing)
    monkeypatch.setattr(os, "link", linking)
    secret = links.load_or_create_secret(tmp_path)
    assert steps == ["fsync file", "link", "fsync folder"]
    assert (tmp_path / "link_secret").read_bytes() == secret


def test_dropping_a_failed_jobs_attempts_spares_later_ones_and_other_files(tmp_path: Path):
    """A job that ended without success at attempt 2: its attempts' folders, whole or hidden, go;
    a later attempt's (an admin retried it meanwhile) and anything not an attempt's stay."""
    store, job = storage.ResultStore(tmp_path), uuid.uuid4()
    folder = tmp_path / "results" / str(job)
    names = ["1", ".1.partial", "2", ".2.partial", "3", ".3.partial", "10", "other", ".x.partial"]
    for name in names:
        (folder / name).mkdir(parents=True)
        (folder / name / "out.txt").write_text(name)
    store.drop_attempts(job, upto=2)
    assert sorted(os.listdir(folder)) == sorted(["3", ".3.partial", "10", "other", ".x.partial"])
    store.drop_attempts(uuid.uuid4(), upto=5)  # a job with no results folder: nothing to do


ENOSPC_LINE = "OSError: [Errno 28] No space left on device"
EDQUOT_LINE = "OSError: [Errno 122] Disk quota exceeded: 'out/a'"


@pytest.mark.parametrize(
    ("said", "line"),
    [
        (f"Traceback ...\n{ENOSPC_LINE}\n", ENOSPC_LINE),
        ("write /out/mesh.glb: no space left on device", "write /out/mesh.glb: no space left on device"),
        ("Error: ENOSPC: no space left on device, write", "Error: ENOSPC: no space left on device, write"),
        (f"  {EDQUOT_LINE}  \ndone", EDQUOT_LINE),
        ("first: No space left on device\nlater: ENOSPC again", "later: ENOSPC again"),
        ("RuntimeError: CUDA out of memory", None),
        ("ENOSPCX is a word of its own", None),
        ("", None),
    ],
)
def test_the_line_that_names_a_full_disk_is_found(said, line):
    """A run's last words that name a full disk (storage.full_disk_line), the last such line."""
    assert storage.full_disk_line(said) == line


def test_a_runners_temporary_folder_is_its_own_and_a_past_lifes_are_removed(tmp_path: Path):
    """Each warm runner gets a temporary folder of its own (several runners share a runner
    folder). Those a worker's previous life left (killed with it: never removed) go at its next
    start, in every runner folder; another worker's stay."""
    store = storage.ResultStore(tmp_path / "storage")
    folder, other_folder = store.runner_dir("warm", 0), store.runner_dir("cold", 1)
    first, second = store.runner_temp(folder, "host:w1"), store.runner_temp(other_folder, "host:w1")
    (first / "big.tmp").write_bytes(b"x")
    assert store.runner_temp(folder, "host:w1") not in (first, second)
    other = store.runner_temp(folder, "host:w2")
    later = storage.ResultStore(tmp_path / "storage")  # the worker's next life
    later.drop_runner_temps("host:w1")
    assert list(folder.iterdir()) == [other] and list(other_folder.iterdir()) == []
