"""The gpujobs checkout the code runs from (it is installed with `pip install -e`): it holds the
migrations (`alembic.ini`, `migrations/`) and, unless GPUJOBS_STORAGE_DIR says otherwise, the
storage folder, so that every command acts on the service's database wherever it is run."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The default storage folder. A relative default was taken from the current folder: a command run
# elsewhere made a new, empty embedded database there.
STORAGE = ROOT / "storage"
