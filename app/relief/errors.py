"""Every error the relief model raises on purpose, and the exit code each maps to.

    ReliefError              base
    ├── BadInput             exit 65: the image cannot become a mesh (unreadable, empty mask, no alpha)
    └── DeviceUnavailable    exit 64: the requested device cannot be used here (no torch, no CUDA)

Anything else escaping the model is a crash: a non-zero exit the service may retry.
"""

from __future__ import annotations


class ReliefError(Exception):
    """The relief model refused the job."""


class BadInput(ReliefError):
    """The input image cannot be turned into a mesh."""


class DeviceUnavailable(ReliefError):
    """The requested compute device is not available."""
