"""What the operator's docs show can be used as shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app import modelsfile

ROOT = Path(__file__).resolve().parents[2]
MODELS_DOC = ROOT / "docs" / "models.md"
TOML_BLOCKS = re.findall(r"```toml\n(.*?)```", MODELS_DOC.read_text(), re.S)


@pytest.mark.parametrize("block", TOML_BLOCKS, ids=[f"block{i}" for i in range(len(TOML_BLOCKS))])
def test_every_registry_example_in_docs_models_loads(block, tmp_path):
    """The registry example of docs/models.md used `{width_mm}` in its argv without declaring the
    parameter: copied into GPUJOBS_MODELS_FILE, it stopped the service at start."""
    path = tmp_path / "models.toml"
    path.write_text(block)
    assert modelsfile.load_registry(path).models
