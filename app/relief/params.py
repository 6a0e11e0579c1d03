"""The knobs of one relief job, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class MaskMode(StrEnum):
    """Which pixels become part of the mesh."""

    AUTO = "auto"  # use alpha when the image has some transparency
    ALPHA = "alpha"  # cut out alpha < 0.5; the image must have an alpha channel
    NONE = "none"  # keep every pixel


class Device(StrEnum):
    """Where the heightmap is computed."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
    # Not advertised: PyTorch on the CPU, so tests can compare the torch path with numpy.
    TORCH_CPU = "torch-cpu"


# Inclusive ranges; the CLI and in-process callers share them through ReliefParams.
LIMITS: dict[str, tuple[float, float]] = {
    "width_mm": (1.0, 10_000.0),
    "depth_mm": (0.0, 1_000.0),
    # A positive base keeps the darkest points off z=0, so the solid never pinches to zero thickness.
    "base_mm": (0.1, 1_000.0),
    "resolution": (16, 1024),
    "smoothing": (0.0, 10.0),
}


@dataclass(frozen=True, slots=True)
class ReliefParams:
    """Geometry settings for one relief mesh; sizes in millimetres, grid sizes in cells."""

    width_mm: float = 100.0
    depth_mm: float = 5.0
    base_mm: float = 2.0
    resolution: int = 256
    invert: bool = False
    smoothing: float = 1.0
    mask: MaskMode = MaskMode.AUTO

    def __post_init__(self) -> None:
        choices = [mode.value for mode in MaskMode]
        if self.mask not in choices:
            raise ValueError(f"mask must be one of {', '.join(choices)}, got {self.mask!r}")
        # A plain "none" equals MaskMode.NONE but is not it, and the mask is compared by identity.
        object.__setattr__(self, "mask", MaskMode(self.mask))
        if not isinstance(self.invert, bool):  # "false" would be true
            raise ValueError(f"invert must be true or false, got {self.invert!r}")
        for name, (low, high) in LIMITS.items():
            value = getattr(self, name)
            # `not low <= value` also rejects NaN, which compares false with everything.
            if not (low <= value <= high):
                raise ValueError(f"{name} must be between {low:g} and {high:g}, got {value}")
        if not isinstance(self.resolution, int):
            raise ValueError(f"resolution must be an integer, got {self.resolution!r}")
