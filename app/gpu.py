"""GPU inventory: which GPUs this host has and how many MB each may still hand out.

"MB" means MiB (2**20 bytes) everywhere in this module.

Indexes are NVML's (PCI bus order). CUDA numbers devices fastest-first unless
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, so a runner should pin a job with `CUDA_VISIBLE_DEVICES=<uuid>`
rather than with the index.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final, Protocol

from app import errors

logger = logging.getLogger("gpujobs.gpu")

MB: Final = 1 << 20
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)
# GB and GiB are the same here: GPU memory is sold and reported in binary units.
_UNIT_MB: Final = {
    "": 1, "m": 1, "mb": 1, "mib": 1,
    "g": 1024, "gb": 1024, "gib": 1024,
    "t": 1024 * 1024, "tb": 1024 * 1024, "tib": 1024 * 1024,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as read at one moment."""

    index: int
    name: str
    uuid: str
    total_mb: int
    free_mb: int
    virtual: bool
    # Why NVML could not read it (fallen off the bus, say); it is then shown full (free_mb 0) with
    # the last total read, so no job is placed on it while the host's other GPUs go on.
    error: str | None = None


class GpuInventory(Protocol):
    """Where a worker reads its GPUs from."""

    def snapshot(self) -> list[Gpu]:
        """A fresh reading of every GPU (free memory is re-read each call)."""
        ...

    def process_memory_mb(self) -> dict[int, int]:
        """MB of GPU memory used per pid, summed over all GPUs; {} when unknown."""
        ...

    def close(self) -> None:
        """Release the underlying library; the inventory is unusable afterwards."""
        ...


class _NoMismatchError(Exception):
    """Stands in for pynvml.NVMLLibraryMismatchError in builds that lack it."""


def _nvml_error(doing: str, exc: BaseException) -> errors.AppError:
    # One place to change once errors.py grows a GPU-specific class.
    error = errors.AppError(f"NVML: {doing} failed: {exc}")
    error.__cause__ = exc  # kept when the error is returned rather than raised
    return error


# NVML's return codes for a call an older driver lacks: not supported, function not found,
# argument version mismatch.
_UNSUPPORTED: Final = frozenset({3, 13, 25})


def _unsupported(exc: BaseException) -> bool:
    """Whether NVML's error says the call is missing or not supported (an older driver)."""
    return getattr(exc, "value", None) in _UNSUPPORTED


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlInventory:
    """The host's real GPUs, read through NVML (`pynvml` from nvidia-ml-py)."""

    def __init__(self, nvml: ModuleType | None = None, *, visible: str | None = None) -> None:
        """Initialise NVML; raises `errors.AppError` naming the reason when it cannot. `visible`:
        the worker's CUDA_VISIBLE_DEVICES, the GPUs it may use (None: every one; see `select`)."""
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise errors.AppError("pynvml (nvidia-ml-py) is not installed") from exc
        self._nvml: Any = nvml
        self._closed = False
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise _nvml_error("nvmlInit", exc) from exc
        try:
            count = int(nvml.nvmlDeviceGetCount())
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
            self._indexes = list(range(count)) if visible is None else select(visible, uuids)
            self._handles = [handles[i] for i in self._indexes]
            self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._uuids = [uuids[i] for i in self._indexes]
        except nvml.NVMLError as exc:
            self.close()
            raise _nvml_error("listing devices", exc) from exc
        except errors.ConfigError:
            self.close()
            raise
        self._totals_mb = [0] * len(self._handles)  # each GPU's size as last read
        # NVML's memory info v2 (newer drivers) tells the driver's own reservation apart;
        # v1 counts it as used, so an idle GPU never shows its total free. False once v2 failed.
        self._v2 = hasattr(nvml, "nvmlMemory_v2")
        self._unreadable: set[int] = set()  # GPUs whose last reading failed (said once per outage)

    @property
    def indexes(self) -> list[int]:
        """NVML's indexes of the GPUs this worker may use."""
        return list(self._indexes)

    @property
    def device_count(self) -> int:
        """How many GPUs this worker may use: those NVML sees, narrowed by `visible`."""
        return len(self._handles)

    def snapshot(self) -> list[Gpu]:
        """Every GPU with its total and current free memory. One NVML cannot read is shown full,
        with the error; only when no GPU can be read does this raise."""
        nvml = self._ready()
        gpus, failed = [], {}
        for at, (index, handle) in enumerate(zip(self._indexes, self._handles, strict=True)):
            try:
                total, free = self._memory(handle)
            except nvml.NVMLError as exc:
                failed[index] = _nvml_error(f"reading memory of GPU {index}", exc)
                free_mb = 0
            else:
                self._totals_mb[at], free_mb = total // MB, free // MB
            error = failed[index].message if index in failed else None
            name, uuid = self._names[at], self._uuids[at]
            gpus.append(Gpu(index, name, uuid, self._totals_mb[at], free_mb, False, error))
        self._note_unreadable(failed)
        return gpus

    def _memory(self, handle: object) -> tuple[int, int]:
        """(bytes a GPU can give its programs, bytes free now). The size leaves out what the driver
        reserves for itself (memory info v2), which no program can have: with it, a job sized
        between an idle GPU's free memory and its total was taken, or grown after running out of
        memory, and then never fitted. Drivers without v2 answer v1: the total, the driver's part
        in it."""
        nvml = self._nvml
        if self._v2:
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            except (nvml.NVMLError, TypeError) as exc:  # TypeError: bindings without `version`
                if not isinstance(exc, TypeError) and not _unsupported(exc):
                    raise
                self._v2 = False
                logger.info("NVML has no memory info v2 (%s); GPU sizes include the driver's reserve", exc)
            else:
                return int(memory.total) - int(memory.reserved), int(memory.free)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(memory.total), int(memory.free)

    def process_memory_mb(self) -> dict[int, int]:
        """MB used per pid by compute processes (host pids; unknown amounts are left out), on the
        GPUs NVML can read; only when it can read none does this raise."""
        nvml = self._ready()
        usage: dict[int, int] = {}
        failed = {}
        for index, handle in zip(self._indexes, self._handles, strict=True):
            try:
                processes = self._compute_processes(handle)
            except nvml.NVMLError as exc:
                failed[index] = _nvml_error(f"listing processes on GPU {index}", exc)
                continue
            for process in processes:
                if process.usedGpuMemory is None:
                    continue
                pid = int(process.pid)
                usage[pid] = usage.get(pid, 0) + math.ceil(int(process.usedGpuMemory) / MB)
        if failed and len(failed) == len(self._handles):
            raise next(iter(failed.values()))
        return usage

    def _note_unreadable(self, failed: Mapping[int, errors.AppError]) -> None:
        """Raise when no GPU could be read; log a GPU that could not be, or is read again, once."""
        if failed and len(failed) == len(self._handles):
            raise next(iter(failed.values()))
        for index, exc in failed.items():
            if index not in self._unreadable:
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                logger.warning(
                    "GPU %d could not be read; no job is placed on it: %s",
                    index,
                    cause,
                    extra={"action": "gpu_unreadable", "gpu": index},
                )
        for index in self._unreadable - failed.keys():
            logger.info("GPU %d read again", index, extra={"action": "gpu_read_again", "gpu": index})
        self._unreadable = set(failed)

    def close(self) -> None:
        """Shut NVML down once; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            logger.warning("NVML shutdown failed: %s", exc, extra={"action": "nvml_shutdown"})

    def _ready(self) -> Any:
        if self._closed:
            raise errors.AppError("NVML: the GPU inventory is closed")
        return self._nvml

    def _compute_processes(self, handle: object) -> list[Any]:
        nvml = self._nvml
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", _NoMismatchError)
        try:
            return list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except mismatch:
            # Drivers older than the bindings lack the _v3 call the unversioned name uses.
            return list(nvml.nvmlDeviceGetComputeRunningProcesses_v2(handle))


class VirtualInventory:
    """Configured GPUs for hosts without NVML: always completely free."""

    def __init__(self, sizes_mb: Sequence[int]) -> None:
        """Make one virtual GPU per size (MB)."""
        for size in sizes_mb:
            if size < 1:
                raise errors.ConfigError(f"virtual GPU size must be at least 1 MB, got {size}")
        self._sizes = tuple(sizes_mb)

    def snapshot(self) -> list[Gpu]:
        """The configured GPUs; free_mb equals total_mb."""
        return [
            Gpu(index=i, name=f"virtual-{i}", uuid=f"virtual-{i}", total_mb=s, free_mb=s, virtual=True)
            for i, s in enumerate(self._sizes)
        ]

    def process_memory_mb(self) -> dict[int, int]:
        """Always {}: nothing measures virtual GPUs."""
        return {}

    def close(self) -> None:
        """Nothing to release."""


MAX_GPU_MB = 2**31 - 1  # what a GPU may be said to hold: PostgreSQL's integer, in MB


def parse_sizes(text: str, *, setting: str = "GPUJOBS_GPUS") -> list[int]:
    """Parse "24GiB,8000MB,1.5GiB,8000" into MB; GB means GiB and a bare number means MB."""
    sizes: list[int] = []
    for raw in text.split(","):
        item = raw.strip()
        match = _SIZE.fullmatch(item)
        unit_mb = _UNIT_MB.get(match[2].lower()) if match else None
        if match is None or unit_mb is None:
            raise errors.ConfigError(
                f"{setting}: {item!r} is not a GPU size (examples: 24GiB, 8000MB, 1.5GiB, 8000)"
            )
        size_mb = int(float(match[1]) * unit_mb)
        if size_mb < 1:
            raise errors.ConfigError(f"{setting}: {item!r} is smaller than 1 MB")
        if size_mb > MAX_GPU_MB:  # the claim counts MB in PostgreSQL's integer
            raise errors.ConfigError(f"{setting}: {item!r} is larger than {MAX_GPU_MB} MB (2 PiB)")
        sizes.append(size_mb)
    return sizes


def select(visible: str, uuids: Sequence[str]) -> list[int]:
    """The NVML indexes of the GPUs `visible` names (CUDA_VISIBLE_DEVICES: indexes in PCI bus
    order, as NVML and nvidia-smi number them, or GPU UUIDs, whole or a unique prefix), in NVML's
    order; "" or -1: none. ConfigError for an entry that names no GPU, or one named twice."""
    chosen: list[int] = []
    entries = [e.strip() for e in visible.split(",")] if visible.strip() not in ("", "-1") else []
    for entry in entries:
        if entry.isdigit():
            found = [int(entry)] if int(entry) < len(uuids) else []
        else:
            found = [i for i, u in enumerate(uuids) if u.lower().startswith(entry.lower())] if entry else []
        if len(found) != 1 or found[0] in chosen:
            listed = ", ".join(f"{i}: {u}" for i, u in enumerate(uuids)) or "none"
            why = "names a GPU twice" if found and found[0] in chosen else "matches no single GPU"
            raise errors.ConfigError(
                f"CUDA_VISIBLE_DEVICES={visible!r}: {entry!r} {why}; give indexes in PCI bus order"
                f" (as nvidia-smi numbers them) or UUIDs. GPUs here: {listed}"
            )
        chosen.append(found[0])
    return sorted(chosen)


def detect_inventory(
    configured: str | None,
    default_virtual_mb: int,
    *,
    nvml: ModuleType | None = None,
    visible: str | None = None,
) -> GpuInventory:
    """NVML when it works and sees a GPU (of those `visible` names: the worker's
    CUDA_VISIBLE_DEVICES; None: all); otherwise virtual GPUs, announced by one warning."""
    sizes = parse_sizes(configured) if configured else None
    try:
        inventory = NvmlInventory(nvml, visible=visible)
    except errors.ConfigError:
        raise
    except errors.AppError as exc:
        reason = exc.message
    else:
        if inventory.device_count > 0:
            if visible is not None:
                logger.info(
                    "CUDA_VISIBLE_DEVICES=%r: this worker uses GPU(s) %s",
                    visible,
                    ", ".join(str(g) for g in inventory.indexes),
                    extra={"action": "gpus_chosen"},
                )
            if sizes is not None:
                logger.warning(
                    "GPUJOBS_GPUS=%r is ignored: NVML sees %d GPU(s)",
                    configured,
                    inventory.device_count,
                    extra={"action": "gpu_config_ignored"},
                )
            return inventory
        inventory.close()
        reason = "NVML sees no GPU" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r} names none"
    return _virtual_fallback(reason, sizes, default_virtual_mb)


def _virtual_fallback(reason: str, sizes: list[int] | None, default_mb: int) -> VirtualInventory:
    source = "GPUJOBS_GPUS" if sizes is not None else "GPUJOBS_VIRTUAL_GPU_MB"
    sizes = sizes if sizes is not None else [default_mb]
    inventory = VirtualInventory(sizes)
    logger.warning(
        "No usable NVIDIA GPU (%s); using %d virtual GPU(s) from %s: %s",
        reason,
        len(sizes),
        source,
        ", ".join(f"{size} MB" for size in sizes),
        extra={"action": "gpu_virtual_fallback"},
    )
    return inventory


def room_mb(gpu: Gpu, *, reserved_mb: int, buffer_mb: int, unseen_mb: int = 0, evictable_mb: int = 0) -> int:
    """MB this GPU may still hand out: min(total - buffer - reserved, free - buffer - unseen +
    evictable); below 0 when NVML's free figure falls short of the buffer (a deficit, which memory
    made free pays first). `unseen_mb`: memory of jobs in hand that NVML's free figure does not show
    yet; `evictable_mb`: memory NVML shows taken that can be had back (idle warm runners)."""
    return min(gpu.total_mb - buffer_mb - reserved_mb, gpu.free_mb - buffer_mb - unseen_mb + evictable_mb)


def available_mb(gpu: Gpu, *, reserved_mb: int, buffer_mb: int) -> int:
    """`room_mb` with nothing unseen or evictable, at least 0 (the simulator's budget)."""
    return max(0, room_mb(gpu, reserved_mb=reserved_mb, buffer_mb=buffer_mb))


def fits(need_mb: int, budget_mb: int) -> bool:
    """Whether a job needing need_mb fits in budget_mb."""
    return need_mb <= budget_mb


def place(need_mb: int, budgets: Mapping[int, int]) -> int | None:
    """The GPU index with the smallest budget that still fits need_mb (ties: lowest index)."""
    fitting = [(budget, index) for index, budget in budgets.items() if fits(need_mb, budget)]
    return min(fitting)[1] if fitting else None


def group_usage_mb(inventory: GpuInventory, pgid: int) -> dict[int, int]:
    """GPU memory (MB) held by each process of process group `pgid` (a model and its children)."""
    usage = {}
    for pid, used_mb in inventory.process_memory_mb().items():
        try:
            if pid == pgid or os.getpgid(pid) == pgid:
                usage[pid] = used_mb
        except ProcessLookupError:  # ended since NVML listed it (or lives in another pid namespace)
            continue
    return usage
