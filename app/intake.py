"""Intake: validate a submission, check its image, queue the job. The API's one call for POST /jobs."""

from __future__ import annotations

import asyncio
import contextlib
import decimal
import functools
import hashlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from app import errors, images, learning, registry
from app.queue import manager as manager_
from app.queue import records
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


class _Keys:
    """json.loads' object_pairs_hook: each object as a dict, noting the first one that gives a key
    more than once (JSON takes the last of them, without a word)."""

    def __init__(self) -> None:
        self.objects = 0  # objects decoded so far: the outermost one comes last
        self.repeated: tuple[int, str, int] | None = None  # (its object's number, key, times)

    def __call__(self, items: list[tuple[str, Any]]) -> dict[str, Any]:
        self.objects += 1
        value = dict(items)
        if len(value) < len(items) and self.repeated is None:
            key, times = next((k, n) for k, n in Counter(k for k, _ in items).items() if n > 1)
            self.repeated = (self.objects, key, times)
        return value

    def check(self) -> None:
        """InvalidParams naming the key given twice, if one was."""
        if self.repeated is None:
            return
        number, key, times = self.repeated
        if number == self.objects:
            raise errors.InvalidParams(
                f"params.{key}: given {times} times; send it once", field=f"params.{key}"
            )
        raise errors.InvalidParams(
            f"params: key {key!r} is given {times} times in a nested object; send it once", field="params"
        )


def parse_params(raw: str | None) -> dict[str, Any]:
    """The `params` form field: a JSON object, or nothing; a key given twice is refused, as a form
    field sent twice is (api/jobs.py, check_fields)."""
    if raw is None or raw.strip() == "":
        return {}
    keys = _Keys()
    try:
        value = json.loads(raw, object_pairs_hook=keys)
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
    keys.check()
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
    key_id: int | None = None,
) -> tuple[Job, bool]:
    """Check everything, store the image, queue the job; (job, created). Nothing is stored on error,
    nor when the API key `key_id` (the one the request came with) was revoked meanwhile (KeyRevoked).

    A repeated idempotency key gives back its job if the request is the same (check_repeat), else
    Conflict; a repeat refused now (the registry changed since) gets its job if sent the same.
    `gate`, if given, is held while the job is written to the database.
    """
    sent = None if idempotency_key is None else fingerprint(model, params, priority)
    refused = functools.partial(
        refused_repeat, manager, owner=owner, key=idempotency_key, sent=sent, limits=limits
    )
    try:
        spec, values = _checked_request(models, model, params, priority, limits)
    except errors.InvalidRequest as exc:
        return await refused(exc, image=image), False
    checked = await check_image(image, limits)
    try:
        vram_mb, declared = await vram_for(spec, checked, learner)
    except errors.InvalidRequest as exc:
        return await refused(exc, image=checked), False
    new = records.NewJob(
        owner=owner, model=spec.name, params=values, priority=priority, vram_mb=vram_mb,
        declared_vram_mb=declared, max_attempts=spec.max_attempts, idempotency_key=idempotency_key,
        request_sha256=sent, key_id=key_id,
    )  # fmt: skip
    return await _enqueue(manager, new, checked, limits, gate)


async def _enqueue(
    manager: manager_.JobManager,
    new: records.NewJob,
    checked: records.NewInput,
    limits: Limits,
    gate: asyncio.Semaphore | None,
) -> tuple[Job, bool]:
    """Queue the job under `gate`; a repeated idempotency key's job if the request is the same."""
    async with gate or contextlib.nullcontext():
        job, created = await manager.enqueue(
            new, checked, queue_limit=limits.queue_limit, owner_limit=limits.queue_limit_per_key
        )
    if not created:
        await check_repeat(manager, job, new, checked)
    return job, created


def _checked_request(
    models: registry.Registry, model: str, params: Mapping[str, Any], priority: int, limits: Limits
) -> tuple[registry.ModelSpec, dict[str, registry.Value]]:
    """The model's spec and its params, defaults filled in; InvalidRequest for what is wrong."""
    spec = models.get(model)
    values = spec.validate_params(params)
    check_priority(priority, limits)
    return spec, values


async def vram_for(
    spec: registry.ModelSpec, image: records.NewInput, learner: learning.VramLearner | None
) -> tuple[int, int]:
    """(MB to admit the job on, the declared estimate). InvalidRequest where that is more than the
    largest GPU of the model's workers offers: no worker could ever claim the job, which would wait
    in the queue for good. With no worker of the model seen in a day, any size is taken."""
    declared = spec.estimate_vram_mb(image.megapixels)
    if learner is None:
        return declared, declared
    vram_mb, _ = await learner.estimate(spec, image.megapixels)
    offered = await learner.offered_mb(spec.name)
    if offered is None or vram_mb <= offered:
        return vram_mb, declared
    most = learner.largest_megapixels(spec, offered, image.megapixels)
    fix = (
        f"send an image of at most {most:g} megapixels"
        if most is not None
        else "no image fits, whatever its size; ask the operator for a worker with a larger GPU"
    )
    raise errors.InvalidRequest(
        f"image: {image.width}x{image.height} ({round(image.megapixels, 2):g} MP) needs {vram_mb} MB of"
        f" GPU memory for model {spec.name!r}; the largest GPU serving it offers {offered} MB: {fix}",
        field="image",
    )


async def refused_repeat(
    manager: manager_.JobManager,
    refused: errors.InvalidRequest,
    *,
    owner: str,
    key: str | None,
    sent: str | None,
    image: BinaryIO | records.NewInput,
    limits: Limits,
) -> Job:
    """The job of this idempotency key if this request, `refused` now, is the one that made it, as
    sent then: a retry during a restart that removed its model, or checks its params more strictly,
    or after a worker with a smaller GPU than the job needs reported, gets its job. Else `refused`
    (also for a job queued before requests were recorded as sent). `image`: the upload, or the
    upload once checked. Without a key, `refused` at once."""
    if key is None:
        raise refused
    job = await manager.find_idempotent(owner, key)
    if job is None or job.request_sha256 != sent:  # NULL: queued before requests were recorded
        raise refused
    try:
        checked = image if isinstance(image, records.NewInput) else await check_image(image, limits)
    except errors.AppError:
        raise refused from None
    if await _other_image(manager, job, checked):
        raise refused
    return job


def fingerprint(model: str, params: Mapping[str, Any], priority: int) -> str:
    """SHA-256 of a request as the client sent it (model, params, priority), in a canonical JSON."""
    try:
        text = _canonical({"model": model, "params": dict(params), "priority": priority})
    except RecursionError as exc:
        raise errors.InvalidParams("params: nested too deeply", field="params") from exc
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value: Any) -> str:
    """`value` as JSON written one way: keys sorted, ASCII, each number by its decimal value (80 and
    80.0 are one number to JSON, and to the comparison of params with defaults filled in)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_canonical(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_canonical, value)) + "]"
    if isinstance(value, int | float) and not isinstance(value, bool):
        written = repr(value)  # exact: a precision of as many digits as it has rounds nothing
        number = decimal.Context(prec=len(written)).normalize(decimal.Decimal(written))
        return "0" if number.is_zero() else str(number)
    return json.dumps(value)


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
    manager: manager_.JobManager, job: Job, new: records.NewJob, image: records.NewInput
) -> None:
    """Conflict unless `job`, the earlier job of this idempotency key, was asked for with the same
    image, model, params and priority as `new`: a key names one request, and answering another
    with its job would hand back a mesh of the wrong image. Runs only for repeats.

    The same model, params and priority as sent then; else (sent otherwise, or a job queued before
    requests were recorded as sent) the same once the defaults are filled in. Compared only so,
    a repeat after a restart that changed a default was another request."""
    differs = []
    if new.request_sha256 is None or new.request_sha256 != job.request_sha256:
        differs = [
            name
            for name, same in (
                ("model", job.model == new.model),
                ("params", _same_json(job.params, dict(new.params))),
                ("priority", job.priority == new.priority),
            )
            if not same
        ]
    if await _other_image(manager, job, image):
        differs.insert(0, "image")
    if differs:
        raise errors.Conflict(
            f"Idempotency-Key {new.idempotency_key!r} was already used for job {job.id}, whose "
            f"{' and '.join(differs)} {'differ' if len(differs) > 1 else 'differs'} from this request's;"
            " send a new key to queue a new job"
        )


async def _other_image(manager: manager_.JobManager, job: Job, image: records.NewInput) -> bool:
    """Whether `job` was made from another image (not known once retention deleted its image)."""
    if job.input_id is None:
        return False
    stored = await manager.inputs.sha256(job.input_id)
    return stored is not None and stored != image.sha256


async def check_image(image: BinaryIO, limits: Limits) -> records.NewInput:
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
    async with DECODING.hold(images.decoded_pixels(data), most=limits.max_pixels):
        return await asyncio.to_thread(images.inspect, data, max_pixels=limits.max_pixels)


class DecodeBudget:
    """The pixels this process's image checks may hold at once: at most one image of the largest
    size allowed (GPUJOBS_MAX_IMAGE_MEGAPIXELS), or several smaller ones. A small file can hold many
    pixels (a WebP of 64 MP in a few KB decodes to 192 MB): checked side by side without a bound,
    a few such uploads of one key took the API, and the worker `serve` runs beside it, a gigabyte."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held = 0
        self._freed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, pixels: int, *, most: int) -> AsyncIterator[None]:
        """Hold `pixels` (no more than `most`, the budget) for the block, waiting for room."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (tests make one each): nothing held there yet
            self._loop, self._held, self._freed = loop, 0, asyncio.Event()
        want = min(pixels, most)
        while self._held and self._held + want > most:
            self._freed.clear()
            await self._freed.wait()
        self._held += want
        try:
            yield
        finally:
            self._held -= want
            self._freed.set()


DECODING = DecodeBudget()
