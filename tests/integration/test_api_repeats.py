"""A request repeated with its Idempotency-Key after the registry changed (a rolling restart):
two API apps, each with its own registry, on one database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import text

from app.settings import Settings
from tests.conftest import api_client, png_bytes, script_model
from tests.integration.test_api_intake import counts, submit

KEY = {"Idempotency-Key": "retry-1"}


def registry(folder: Path, name: str, *, default: int = 5, most: int = 100, model: str = "shape") -> Path:
    """A registry file with `model`, whose int parameter `depth` has `default` and maximum `most`."""
    path = folder / f"{name}.toml"
    entry = script_model(model, ["{python}", "-c", "pass", "{output_dir}", "{depth}"])
    path.write_text(
        entry + f'[models.{model}.params.depth]\ntype = "int"\ndefault = {default}\nmax = {most}\n'
    )
    return path


async def first_then_again(
    settings: Settings,
    png: Any,
    before: Path,
    after: Path,
    *,
    form: dict[str, Any] | None = None,
    again: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """POST a `shape` job (`form`) with the key under registry `before`, then again under `after`
    (`again`: the second request's form, else the same)."""
    image, form = png(color=(3, 1, 4)), form or {"model": "shape"}
    async with api_client(settings, models_file=before) as http:
        first = await submit(http, image, headers=KEY, **form)
    assert first.status_code == 201, first.text
    async with api_client(settings, models_file=after) as http:
        second = await submit(http, image, headers=KEY, **(again or form))
    return first, second


async def test_a_repeat_after_a_default_changed_gets_its_job(settings, png, engine, tmp_path):
    """The repeat was compared with the job by its params with the defaults filled in: after a
    restart that changed a default the very same request was 409, "a different params"."""
    first, again = await first_then_again(
        settings, png, registry(tmp_path, "old", default=5), registry(tmp_path, "new", default=6)
    )
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"] and again.json()["params"] == {"depth": 5}
    assert await counts(engine) == (1, 1, 1)


async def test_a_repeat_spelling_out_the_default_it_ran_with_gets_its_job(settings, png, tmp_path):
    """Not the same as sent, but the job it names runs with exactly these params."""
    first, again = await first_then_again(
        settings,
        png,
        registry(tmp_path, "old", default=5),
        registry(tmp_path, "new", default=6),
        again={"model": "shape", "params": {"depth": 5}},
    )
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]


async def test_a_repeat_with_another_value_is_still_409(settings, png, engine, tmp_path):
    first, again = await first_then_again(
        settings,
        png,
        registry(tmp_path, "old", default=5),
        registry(tmp_path, "new", default=6),
        again={"model": "shape", "params": {"depth": 6}},
    )
    assert again.status_code == 409, again.text
    assert first.json()["id"] in again.json()["detail"] and "params" in again.json()["detail"]
    assert await counts(engine) == (1, 1, 1)


async def test_a_repeat_after_its_model_was_removed_gets_its_job(settings, png, engine, tmp_path):
    """The retry was refused, 422 unknown model, although its job was queued (and may have run)."""
    first, again = await first_then_again(
        settings, png, registry(tmp_path, "old"), registry(tmp_path, "new", model="other")
    )
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert await counts(engine) == (1, 1, 1)


async def test_a_repeat_after_its_params_became_refused_gets_its_job(settings, png, tmp_path):
    first, again = await first_then_again(
        settings,
        png,
        registry(tmp_path, "old"),
        registry(tmp_path, "new", most=10),
        form={"model": "shape", "params": {"depth": 50}},
    )
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]


async def test_another_request_with_the_key_after_removal_is_refused(settings, png, engine, tmp_path):
    """Another request under a model that is gone still says what is wrong with it."""
    old, new = registry(tmp_path, "old"), registry(tmp_path, "new", model="other")
    _, other_params = await first_then_again(
        settings, png, old, new, again={"model": "shape", "params": {"depth": 7}}
    )
    assert other_params.status_code == 422, other_params.text
    assert "unknown model 'shape'" in other_params.json()["detail"], other_params.text
    async with api_client(settings, models_file=new) as http:
        other_image = await submit(http, png(color=(9, 9, 9)), model="shape", headers=KEY)
    assert other_image.status_code == 422, other_image.text
    assert await counts(engine) == (1, 1, 1)


async def test_a_repeat_of_a_job_queued_before_the_upgrade_is_compared_as_before(
    settings, png, engine, tmp_path
):
    """A job queued before requests were recorded as sent: its params with defaults filled in."""
    old = registry(tmp_path, "old")
    async with api_client(settings, models_file=old) as http:
        first = await submit(http, png(), model="shape", headers=KEY)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE jobs SET request_sha256 = NULL"))
        again = await submit(http, png(), model="shape", headers=KEY)
        other = await submit(http, png(), model="shape", params={"depth": 6}, headers=KEY)
    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 409)
    assert again.json()["id"] == first.json()["id"]


async def test_a_jobs_read_by_its_idempotency_key_rides_through_a_column_a_migration_adds(manager, engine):
    """A refused repeat and an upload that lost its key's race read their job by its idempotency key
    (`SELECT * FROM jobs`, through SQLAlchemy). Once another process's migration added a column to
    `jobs` (0008 did, under the code before it), that read failed once per pooled connection:
    "cached statement plan is invalid". The uploads' own statement never did (asyncpg prepares it
    again), and this read now goes the same way."""
    for _ in range(3):  # prepared and cached on the pooled connection
        assert await manager.find_idempotent("alice", "k") is None
    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE jobs ADD COLUMN added_by_a_newer_release text"))
    assert await manager.find_idempotent("alice", "k") is None


async def test_uploads_ride_through_a_column_a_migration_adds_under_a_running_api(settings, engine):
    async with api_client(settings) as http:
        images = iter(range(1, 7))

        async def upload() -> int:
            n = next(images)
            sent = await submit(http, png_bytes(color=(n, 8, 9)), headers={"Idempotency-Key": f"k{n}"})
            return sent.status_code

        assert [await upload() for _ in range(3)] == [201] * 3  # the statement prepared, cached
        async with engine.begin() as conn:
            await conn.execute(text("ALTER TABLE jobs ADD COLUMN added_by_a_newer_release text"))
        assert [await upload() for _ in range(3)] == [201] * 3
