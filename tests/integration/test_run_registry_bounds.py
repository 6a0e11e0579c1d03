"""The registry's largest figures fit a job row: a submit for such a model is queued, not a 500."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import registry
from tests.conftest import toy_model

STEEP = str(registry.MAX_VRAM_MB)


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy` with the most attempts and the steepest, largest VRAM figures the registry takes."""
    path = tmp_path / "bounds.toml"
    text = toy_model("toy", max_attempts=registry.MAX_ATTEMPTS).replace(
        "vram = { base_mb = 1000, mb_per_megapixel = 0 }",
        f"vram = {{ base_mb = {STEEP}, mb_per_megapixel = {STEEP} }}",
    )
    assert STEEP in text
    path.write_text(text)
    return path


@pytest.mark.asyncio
async def test_the_largest_figures_the_registry_takes_are_queued(client, png) -> None:
    image = png((1200, 1000))  # 1.2 megapixels: base + per-megapixel x 1.2 is past a 32-bit integer
    response = await client.post(
        "/jobs", files={"image": ("a.png", image, "image/png")}, data={"model": "toy"}
    )
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["max_attempts"] == registry.MAX_ATTEMPTS
    assert job["vram_mb"] == registry.MAX_VRAM_MB
