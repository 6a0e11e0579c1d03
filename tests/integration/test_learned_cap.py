"""No job is admitted on more than its model's GPUs can give, whatever the model's declared
maximum: such a job would wait for ever. A learned estimate stays within the largest GPU; a
declared one above it is refused at intake."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.conftest import api_client, png_bytes, toy_model
from tests.integration.test_api_intake import counts
from tests.integration.test_scheduling import ModelMemory
from tests.integration.test_worker import enqueue


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`, declaring a maximum far above the test's 24 GB GPU (as a model made for 80 GB cards),
    and `big`, declaring 4000 MB per megapixel."""
    path = tmp_path / "models.toml"
    path.write_text(
        toy_model("toy").replace("mb_per_megapixel = 0 }", "mb_per_megapixel = 0, max_mb = 80000 }")
        + toy_model("big").replace("mb_per_megapixel = 0 }", "mb_per_megapixel = 4000 }")
    )
    return path


async def test_a_learned_estimate_stays_within_the_largest_gpu_by_default(
    manager, make_worker, settings, tmp_path
):
    """Without GPUJOBS_LEARNED_VRAM_ABOVE_DECLARED the learned figure was capped at the model's
    declared maximum only: a model seen at 23.8 GB for a 1 GB declaration, plus the margin, was
    admitted at 24.8 GB, more than the 24 GB GPU, and no worker ever took the job."""
    marker = str(tmp_path / f"trace-{uuid.uuid4().hex}")
    for _ in range(3):
        await enqueue(manager, vram_mb=1000, sleep=1.2, steps=1, trace=marker)
    await make_worker(inventory=ModelMemory([24_576], 23_800, marker), vram_buffer_mb=512).run()
    overrides = {"learned_vram_min_samples": 3, "learned_vram_margin_mb": 1024, "vram_buffer_mb": 512}
    async with api_client(settings, **overrides) as http:
        response = await http.post(
            "/jobs", files={"image": ("a.png", png_bytes(), "image/png")}, data={"model": "toy"}
        )
    assert response.status_code == 201, response.text
    assert response.json()["vram_mb"] == 24_576 - 512


async def test_an_image_too_large_for_every_gpu_of_its_model_is_refused_at_intake(
    make_worker, settings, engine
):
    """A job whose estimate was more than the largest GPU of its model's workers offered was
    accepted (201) and stayed queued for good, holding a place in the queue, without a word. Now it
    is 422, naming the MB it needs, the MB offered and the largest image that fits, and nothing is
    stored; with no worker of the model reported, it is accepted as before (and a repeat of that
    request with its idempotency key still gets its job)."""
    image = {"image": ("a.png", png_bytes((1000, 1000)), "image/png")}  # 1 MP: 5000 MB
    async with api_client(settings, vram_buffer_mb=512) as http:
        unknown = await http.post(
            "/jobs", files=image, data={"model": "big"}, headers={"Idempotency-Key": "k"}
        )
    assert unknown.status_code == 201, unknown.text
    before = await counts(engine)
    await make_worker([4096], vram_buffer_mb=512).run()  # offers 4096 - 512 = 3584 MB: 0.64 MP at most
    async with api_client(settings, vram_buffer_mb=512) as http:
        refused = await http.post("/jobs", files=image, data={"model": "big"})
        small = await http.post(
            "/jobs", files={"image": ("b.png", png_bytes((600, 600)), "image/png")}, data={"model": "big"}
        )
        repeat = await http.post(
            "/jobs", files=image, data={"model": "big"}, headers={"Idempotency-Key": "k"}
        )
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert isinstance(detail, str)
    for needle in ("image:", "5000 MB", "3584 MB", "at most 0.64 megapixels", "big"):
        assert needle in detail, detail
    assert small.status_code == 201, small.text  # 0.36 MP: 2440 MB
    assert (repeat.status_code, repeat.json()["id"]) == (200, unknown.json()["id"])  # its job, as ever
    assert (await counts(engine))[:2] == (before[0] + 1, before[1] + 1)


async def test_the_refusal_goes_by_what_the_workers_offer_not_by_the_apis_buffer(make_worker, settings):
    """The API took the largest GPU a model's workers reported less its own GPUJOBS_VRAM_BUFFER_MB;
    a worker on another host with a smaller buffer claims more, and the API refused jobs it would
    have run. Each worker now reports what each of its GPUs offers, by its own buffer."""
    await make_worker([4096], vram_buffer_mb=0).run()  # offers all 4096 MB
    image = {"image": ("a.png", png_bytes((866, 866)), "image/png")}  # 0.75 MP: 4000 MB
    async with api_client(settings, vram_buffer_mb=512) as http:
        taken = await http.post("/jobs", files=image, data={"model": "big"})
    assert taken.status_code == 201, taken.text
