"""Backups taken while jobs run, restored beside the installation they came from (a restore drill,
as docs/operations.md "Restore" allows on the same host), by the doc's own blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import bearer, png_bytes, toy_model, worker_name
from tests.integration import test_backup_doc as doc

ROOT = Path(__file__).resolve().parents[2]


def drill_env(tmp_path: Path, name: str) -> dict[str, str]:
    """The environment of one installation's `serve`: this checkout's code, the toy model, short
    leases (a lease of the dump's running jobs runs out in the restored copy within seconds)."""
    models = tmp_path / "models.toml"
    if not models.exists():
        models.write_text(toy_model("toy", timeout_s=120))
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "GPUJOBS_GPUS": "24GiB",
        "GPUJOBS_WORKER_NAME": worker_name(name),  # the drill's own, as the doc asks
        "GPUJOBS_MODELS_FILE": str(models),
        "GPUJOBS_LEASE_S": "4",
        "GPUJOBS_HEARTBEAT_INTERVAL_S": "1",
        "GPUJOBS_REAP_INTERVAL_S": "1",
        "GPUJOBS_LOG_LEVEL": "INFO",
    }


def test_a_restore_drill_on_the_same_host_leaves_the_live_installations_runs_alone(tmp_path):
    """A backup taken while a job runs, restored on the same host beside the live installation
    with its own port, storage folder and worker name (as "Restore" says for a drill). The restored
    copy takes the dump's running job back once its lease runs out there, and looks for what of it
    still runs on this host: it found the live installation's model (same job id, same attempt)
    and killed it, so the live job was retried ('killed by SIGTERM', an attempt spent)."""
    doc.skip_unless_the_doc_can_run()
    blocks = doc.doc_blocks()
    work, live, drill, backups = (tmp_path / name for name in ("work", "storage", "restored", "backups"))
    work.mkdir()
    doc.the_checkout(work)
    env = drill_env(tmp_path, "live")
    with doc.services(live / "pgdata", drill / "pgdata") as start:
        argv = [sys.executable, "-m", "app", "serve"]
        _, port = doc.serving(
            start, argv, work, {**env, "GPUJOBS_STORAGE_DIR": str(live)}, tmp_path / "live.log"
        )
        admin = doc.cli(
            {**env, "GPUJOBS_STORAGE_DIR": str(live)}, "keys", "create", "admin", "--admin"
        ).strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=bearer(admin)) as http:
            form = {"model": "toy", "params": json.dumps({"sleep": 20, "steps": 20})}
            image = {"image": ("p.png", png_bytes((20, 20), (1, 2, 3)), "image/png")}
            job_id = http.post("/jobs", files=image, data=form).json()["id"]
            while http.get(f"/jobs/{job_id}/events").json()[-1]["kind"] != "progress":
                time.sleep(0.1)  # its model runs
            dump = doc.filled(blocks["embedded-dump"], (r"/srv/backups/gpujobs/", f"{backups}/"))
            doc.run_block(work, "backup", dump, {**env, "GPUJOBS_STORAGE_DIR": str(live)})
            [backup] = backups.iterdir()
            (work / "restore.sh").write_text(doc.restore_block(blocks, backup, drill))
            _, drill_port = doc.serving(
                start,
                ["bash", "-eu", "restore.sh"],
                work,
                drill_env(tmp_path, "drill"),
                tmp_path / "drill.log",
            )
            with httpx.Client(base_url=f"http://127.0.0.1:{drill_port}", headers=bearer(admin)) as copy:
                deadline = time.monotonic() + 30
                while copy.get(f"/jobs/{job_id}").json()["attempt"] < 2:  # taken back in the copy
                    assert time.monotonic() < deadline, copy.get(f"/jobs/{job_id}/events").json()
                    time.sleep(0.2)
            deadline = time.monotonic() + 40
            while (job := http.get(f"/jobs/{job_id}").json())["state"] not in ("succeeded", "failed"):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            kinds = [(e["kind"], e["attempt"]) for e in http.get(f"/jobs/{job_id}/events").json()]
            assert (job["state"], job["attempt"]) == ("succeeded", 1), kinds


def test_a_restore_into_the_path_of_a_storage_folder_moved_aside_while_its_serve_runs(tmp_path):
    """ "Restore" says to move an old storage folder aside first (`mv storage storage.old`). Moved
    while its `serve` still ran, its embedded server still runs with `-D .../storage/pgdata`, and
    the restore's new data folder at that path made the wheel kill that server (it takes any
    server of the path it inits for a leftover): the live installation lost its database, and the
    restore stopped with no reason given ("did not start: ; its whole log: ..."). It must be
    refused, naming the server that runs, and leave it running."""
    doc.skip_unless_the_doc_can_run()
    blocks = doc.doc_blocks()
    work, backups = tmp_path / "work", tmp_path / "backups"
    work.mkdir()
    doc.the_checkout(work)
    env = drill_env(tmp_path, "live")
    with doc.services(work / "storage" / "pgdata", work / "storage.old" / "pgdata") as start:
        argv = [sys.executable, "-m", "app", "serve"]
        live_env = {**env, "GPUJOBS_STORAGE_DIR": "storage"}
        doc.serving(start, argv, work, live_env, tmp_path / "live.log")
        dump = doc.filled(blocks["embedded-dump"], (r"/srv/backups/gpujobs/", f"{backups}/"))
        doc.run_block(work, "backup", dump, {**env, "GPUJOBS_STORAGE_DIR": "storage"})
        [backup] = backups.iterdir()
        old_server = doc.server_pid(work / "storage" / "pgdata")
        assert old_server is not None
        (work / "storage").rename(work / "storage.old")  # the comment's `mv storage storage.old`
        restore = doc.restore_block(blocks, backup, Path("storage"))
        restore = restore[: restore.index("GPUJOBS_STORAGE_DIR=$STORAGE")]  # up to the Python step
        (work / "restore.sh").write_text(restore)
        done = subprocess.run(
            ["bash", "-eu", "restore.sh"], cwd=work, env=drill_env(tmp_path, "drill"),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert doc.alive(old_server), f"the restore killed the live server\n{done.stderr}"
        assert done.returncode != 0 and "still runs" in done.stderr, done.stderr
