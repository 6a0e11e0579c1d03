"""The PyTorch path: heightmap.surface's matmuls on CUDA (or on the CPU, for tests).

torch is optional and imported lazily through importlib, typed as Any, so that neither running nor
type-checking the numpy path needs it installed.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from app.relief import errors, heightmap


class TorchBackend:
    """Moves heightmap arrays to and from one torch device; autograd stays off (plain tensors)."""

    def __init__(self, torch: Any, device: str) -> None:
        self._torch = torch
        self._device = torch.device(device)
        label = torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else "cpu"
        self.name = f"{device} (torch {torch.__version__}, {label})"
        # Creating the context now keeps the first job from paying for it.
        torch.zeros(1, device=self._device)

    def upload(self, array: heightmap.FloatArray) -> Any:
        """Copy a numpy array to the device."""
        return self._torch.from_numpy(np.ascontiguousarray(array)).to(self._device)

    def download(self, array: Any) -> heightmap.FloatArray:
        """Copy a tensor back to a numpy array."""
        result: heightmap.FloatArray = array.cpu().numpy()
        return result


def import_torch() -> Any:
    """The torch module; DeviceUnavailable saying why when it cannot be imported."""
    try:
        return importlib.import_module("torch")
    except ModuleNotFoundError as exc:
        if exc.name != "torch":  # torch is there but one of its own imports is missing
            raise errors.DeviceUnavailable(f"PyTorch cannot be imported: {exc}") from exc
        raise errors.DeviceUnavailable("PyTorch is not installed") from exc
    # A CUDA build missing one of its libraries (libcudnn.so.N) fails with OSError, not ImportError.
    except (ImportError, OSError) as exc:
        raise errors.DeviceUnavailable(f"PyTorch cannot be imported: {exc}") from exc


def cuda_backend(torch: Any) -> TorchBackend:
    """A backend on the first visible GPU; DeviceUnavailable when CUDA is missing."""
    if not torch.cuda.is_available():
        raise errors.DeviceUnavailable(
            f"--device cuda: torch {torch.__version__} sees no CUDA device "
            "(check the driver and CUDA_VISIBLE_DEVICES)"
        )
    return TorchBackend(torch, "cuda")
