"""A learned VRAM estimate never passes what the model's GPUs can give, whatever the model's
declared maximum: a job admitted on more than any GPU has would wait for ever."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.conftest import api_client, png_bytes, toy_model
from tests.integration.test_scheduling import ModelMemory
from tests.integration.test_worker import enqueue


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`, declaring a maximum far above the test's 24 GB GPU (as a model made for 80 GB cards)."""
    path = tmp_path / "models.toml"
    path.write_text(
        toy_model("toy").replace("mb_per_megapixel = 0 }", "mb_per_megapixel = 0, max_mb = 80000 }")
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
    await make_worker(inventory=ModelMemory([24_576], 23_800, marker)).run()
    overrides = {"learned_vram_min_samples": 3, "learned_vram_margin_mb": 1024, "vram_buffer_mb": 512}
    async with api_client(settings, **overrides) as http:
        response = await http.post(
            "/jobs", files={"image": ("a.png", png_bytes(), "image/png")}, data={"model": "toy"}
        )
    assert response.status_code == 201, response.text
    assert response.json()["vram_mb"] == 24_576 - 512
