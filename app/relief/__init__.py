"""relief: the reference model, turning an image into a printable 3D relief mesh.

As a program: `python -m app.relief --input IMAGE --output-dir DIR` (see docs/models.md).
From Python, for a process that serves many jobs: `backend = load()` once, then per image
`build_mesh(picture.open_image(path), ReliefParams(...), backend)`.
"""

from __future__ import annotations

from app.relief.errors import BadInput, DeviceUnavailable, ReliefError
from app.relief.params import Device, MaskMode, ReliefParams
from app.relief.pipeline import build_mesh, load

__all__ = [
    "BadInput",
    "Device",
    "DeviceUnavailable",
    "MaskMode",
    "ReliefError",
    "ReliefParams",
    "build_mesh",
    "load",
]
