"""Intake: validate a submission, check its image, queue the job. The API's one call for POST /jobs."""

from __future__ import annotations

import asyncio
import contextlib
import decimal
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from app import errors, images, learning, registry
from app.queue import manager as manager_
from app.queue.jobs import Job

# A plain PNG of up to QUICK_CHECK_BYTES that inflates to at most QUICK_RAW_BYTES is checked on the
# event loop (see check_image): a few milliseconds at most. A small file of flat colour can inflate to
# hundreds of MB within the pixel limit: that one goes to a thread.
QUICK_CHECK_BYTES = 2 * 1024 * 1024
QUICK_RAW_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """What a submission may be."""

    max_upload_bytes: int
    max_pixels: int
    queue_limit: int
    priority_min: int
    priority_max: int
    queue_limit_per_key: int = 0  # 0: no limit per principal


def parse_params(raw: str | None) -> dict[str, Any]:
    """The `params` form field: a JSON object, or nothing."""
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise errors.InvalidParams(
            f"params: not valid JSON ({exc.msg} at {exc.pos})", field="params"
        ) from exc
    except ValueError as exc:  # Python converts at most 4300 digits to an int
        raise errors.InvalidParams("params: a number has too many digits", field="params") from exc
    except RecursionError as exc:
        raise errors.InvalidParams("params: nested too deeply", field="params") from exc
    if not isinstance(value, dict):
        raise errors.InvalidParams('params: must be a JSON object such as {"width_mm": 80}', field="params")
    if "\\u" in raw:  # only an escape can spell half a surrogate pair: no text, and no jsonb
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise errors.InvalidParams(
                "params: a string holds half a UTF-16 surrogate pair (\\ud800-\\udfff alone)",
                field="params",
            ) from exc
    return value


def check_priority(priority: int, limits: Limits) -> int:
    """Priority within the configured bounds."""
    if not limits.priority_min <= priority <= limits.priority_max:
        raise errors.InvalidRequest(
            f"priority: must be between {limits.priority_min} and {limits.priority_max}", field="priority"
        )
    return priority


async def submit(
    manager: manager_.JobManager,
    models: registry.Registry,
    *,
    owner: str,
    model: str,
    priority: int,
    params: Mapping[str, Any],
    image: BinaryIO,
    idempotency_key: str | None,
    limits: Limits,
    learner: learning.VramLearner | None = None,
    gate: asyncio.Semaphore | None = None,
) -> tuple[Job, bool]:
    """Check everything, store the image, queue the job; (job, created). Nothing is stored on error.

    A repeated idempotency key gives back its job if the request is the same, else Conflict.
    `gate`, if given, is held while the job is written to the database.
    """
    spec = models.get(model)
    values = spec.validate_params(params)
    check_priority(priority, limits)
    checked = await check_image(image, limits)
    declared = spec.estimate_vram_mb(checked.megapixels)
    vram_mb = declared if learner is None else (await learner.estimate(spec, checked.megapixels))[0]
    new = manager_.NewJob(
        owner=owner,
        model=spec.name,
        params=values,
        priority=priority,
        vram_mb=vram_mb,
        declared_vram_mb=declared,
        max_attempts=spec.max_attempts,
        idempotency_key=idempotency_key,
    )
    async with gate or contextlib.nullcontext():
        job, created = await manager.enqueue(
            new, checked, queue_limit=limits.queue_limit, owner_limit=limits.queue_limit_per_key
        )
    if not created:
        await check_repeat(manager, job, new, checked)
    return job, created


def _same_json(stored: Any, sent: Any) -> bool:
    """Whether two JSON values are equal, numbers by their decimal value: PostgreSQL keeps a JSON
    number so, and gives a float too large to write without an exponent back as an integer (1e23
    as 100000000000000000000000, which the float 1e23, 99999999999999991611392, does not equal)."""
    if isinstance(stored, dict) and isinstance(sent, dict):
        return stored.keys() == sent.keys() and all(_same_json(stored[k], sent[k]) for k in stored)
    if isinstance(stored, list) and isinstance(sent, list):
        return len(stored) == len(sent) and all(map(_same_json, stored, sent))
    numbers = (int, float)
    if isinstance(stored, numbers) and isinstance(sent, numbers) and bool not in (type(stored), type(sent)):
        return decimal.Decimal(repr(stored)) == decimal.Decimal(repr(sent))
    return bool(stored == sent)


async def check_repeat(
    manager: manager_.JobManager, job: Job, new: manager_.NewJob, image: manager_.NewInput
) -> None:
    """Conflict unless `job`, the earlier job of this idempotency key, was asked for with the same
    image, model, params and priority as `new`: a key names one request, and answering another
    with its job would hand back a mesh of the wrong image. Runs only for repeats."""
    differs = [
        name
        for name, same in (
            ("model", job.model == new.model),
            ("params", _same_json(job.params, dict(new.params))),
            ("priority", job.priority == new.priority),
        )
        if not same
    ]
    if job.input_id is not None:  # else retention deleted the image: nothing to compare with
        stored = await manager.input_sha256(job.input_id)
        if stored is not None and stored != image.sha256:
            differs.insert(0, "image")
    if differs:
        raise errors.Conflict(
            f"Idempotency-Key {new.idempotency_key!r} was already used for job {job.id}, with a "
            f"different {', '.join(differs)}; send a new key to queue a new job"
        )


async def check_image(image: BinaryIO, limits: Limits) -> manager_.NewInput:
    """Read, check and hash the upload. A small plain PNG is checked on the event loop (a
    millisecond or two); anything that takes longer goes to a thread, so the loop never stalls on
    a large image, a large inflate or a full decode. A hop to a thread cost more than the check it
    carried: 0.5-0.8 ms of the API's CPU per 1 MB upload (tests/bench/README.md, fifteenth round)."""
    data = images.read_upload(image, limits.max_upload_bytes)
    rows = images.png_rows(data)
    if len(data) <= QUICK_CHECK_BYTES and rows is not None and rows[0] * rows[1] <= QUICK_RAW_BYTES:
        checked = images.inspect_quickly(data, max_pixels=limits.max_pixels)
        if checked is not None:
            return checked
    return await asyncio.to_thread(images.inspect, data, max_pixels=limits.max_pixels)
