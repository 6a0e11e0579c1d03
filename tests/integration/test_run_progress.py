"""A model that prints progress as fast as it can: its job's row is written a few times a second
whatever the value, and the job ends as soon as its model does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from app import db
from app.queue import sql
from app.queue.jobs import JobState
from tests.conftest import script_model, toy_model
from tests.integration.test_worker import enqueue

RUN_S = 2.0
# Prints PROGRESS <value> in a loop for RUN_S seconds, then writes the time of its last act.
FLOOD = f"""\
import sys, time
end = time.monotonic() + {RUN_S}
while time.monotonic() < end:
    print('PROGRESS ' + sys.argv[2] + ' saving', flush=True)
with open(sys.argv[1] + '/out.txt', 'w') as out:
    out.write(repr(time.time()))
"""


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy` and `flood`, which prints `PROGRESS {value}` without pause for RUN_S seconds."""
    path = tmp_path / "models.toml"
    argv = ["{python}", "-c", FLOOD, "{output_dir}", "{value}"]
    path.write_text(
        toy_model("toy") + script_model("flood", argv) + '[models.flood.params.value]\ntype = "str"\n'
    )
    return path


@pytest.mark.parametrize("value", ["1.0", "45"])
async def test_a_model_repeating_a_finished_progress_is_throttled_and_ends_at_once(
    manager, make_worker, store, settings, value: str
) -> None:
    """Before, the throttle let every value of 1 through (45, a percent, is clamped to 1): one
    UPDATE and NOTIFY per line, hundreds a second, and up to 1,000 of them queued, written one by
    one after the model had exited while the job held its GPU slot. Now the row is written at most
    four times a second and the job succeeds right after its model's last act."""
    job_id = await enqueue(manager, model="flood", value=value)
    heard: list[dict[str, Any]] = []
    listener = await asyncpg.connect(db.asyncpg_dsn(settings.database_url))
    try:
        await listener.add_listener(sql.JOB_CHANNEL, lambda *args: heard.append(json.loads(args[3])))
        await asyncio.wait_for(make_worker().run(), 30)
        await asyncio.sleep(0.2)  # the last notes arrive
    finally:
        await listener.close()
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded, job.error
    writes = [note for note in heard if note["job"] == str(job_id) and note["kind"] is None]
    assert 1 <= len(writes) <= 4 * RUN_S + 3, len(writes)
    path, _, _ = store.resolve(job, "out.txt")
    last_act = float(path.read_text())
    assert job.finished_at is not None
    assert job.finished_at.timestamp() - last_act < 0.5
