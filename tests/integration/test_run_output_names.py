"""A param that names an output file (`name = "mesh-{label}.glb"`) is checked at submit: a value
that would make the name leave the output folder is a 422 naming the param, not a job that runs
and then fails as an internal error of the worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import script_model, toy_model
from tests.integration.test_api_intake import counts


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`, and `named`, whose output's name holds its free-text `label`."""
    path = tmp_path / "models.toml"
    path.write_text(
        toy_model("toy")
        + script_model(
            "named",
            ["{python}", "-c", "pass", "{output_dir}", "{label}"],
            max_attempts=3,
            output="mesh-{label}.glb",
        )
        + '[models.named.params.label]\ntype = "str"\ndefault = "plain"\n'
    )
    return path


@pytest.mark.asyncio
@pytest.mark.parametrize("label", ["x/../../etc", "a b"])
async def test_a_param_that_makes_a_bad_output_name_is_refused_at_submit(client, png, engine, label) -> None:
    response = await client.post(
        "/jobs",
        files={"image": ("a.png", png(), "image/png")},
        data={"model": "named", "params": json.dumps({"label": label})},
    )
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith("params.label: gives the output file name"), response.json()
    assert await counts(engine) == (0, 0, 0)


@pytest.mark.asyncio
async def test_a_param_that_makes_a_good_output_name_is_taken(client, png) -> None:
    response = await client.post(
        "/jobs",
        files={"image": ("a.png", png(), "image/png")},
        data={"model": "named", "params": json.dumps({"label": "v2.final"})},
    )
    assert response.status_code == 201, response.text
