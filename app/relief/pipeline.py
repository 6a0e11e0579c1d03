"""The model's Python entry points: `load()` a backend once, then `build_mesh()` per image."""

from __future__ import annotations

from collections.abc import Callable

import trimesh
from PIL import Image

from app.relief import errors, heightmap, mesh, params, picture, torch_backend

# (fraction 0..1, short message); the CLI prints it as a PROGRESS line.
Progress = Callable[[float, str], None]


def load(device: params.Device | str = params.Device.AUTO) -> heightmap.Backend:
    """Pick and initialise the compute backend; DeviceUnavailable if `device` cannot be used."""
    choice = params.Device(device)
    if choice is params.Device.CPU:
        return heightmap.NumpyBackend()
    try:
        torch = torch_backend.import_torch()
    except errors.DeviceUnavailable as exc:
        if choice is params.Device.AUTO:
            return heightmap.NumpyBackend()  # auto means "PyTorch when it can be used"
        raise errors.DeviceUnavailable(f"--device {choice.value}: {exc}") from exc
    if choice is params.Device.CUDA:
        return torch_backend.cuda_backend(torch)
    if choice is params.Device.TORCH_CPU:
        return torch_backend.TorchBackend(torch, "cpu")
    if torch.cuda.is_available():
        return torch_backend.TorchBackend(torch, "cuda")
    return heightmap.NumpyBackend()


def build_mesh(
    image: Image.Image,
    relief: params.ReliefParams,
    backend: heightmap.Backend | None = None,
    progress: Progress | None = None,
) -> trimesh.Trimesh:
    """Turn an upright image into a watertight relief mesh in millimetres; BadInput if it cannot."""
    report = progress or _ignore
    planes = picture.to_planes(image, relief.mask, relief.resolution)
    grid = heightmap.plan_grid(image.size, relief.resolution, relief.width_mm)
    filters = heightmap.plan_filters(planes.shape, grid, relief.smoothing)
    surface = heightmap.surface(planes, filters, backend or heightmap.NumpyBackend())
    field = heightmap.heights(surface, relief.invert)
    report(0.4, "heightmap")
    result = mesh.build(field, grid.cell_mm, relief.base_mm, relief.depth_mm)
    report(0.7, "mesh")
    return result


def _ignore(fraction: float, message: str) -> None:
    """Progress sink for callers that do not listen."""
