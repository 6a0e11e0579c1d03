"""Test doubles for the seams in app/ (fakes, not patches)."""

from __future__ import annotations

from collections.abc import Sequence

from app import gpu


class FakeInventory:
    """A `gpu.GpuInventory` whose free memory and per-pid usage tests set by hand."""

    def __init__(self, sizes_mb: Sequence[int]) -> None:
        """Make one fake GPU per size (MB), all completely free."""
        self.total_mb = list(sizes_mb)
        self.free_mb = list(sizes_mb)
        self.processes: dict[int, int] = {}
        self.snapshots = 0
        self.closed = False

    def set_free(self, index: int, free_mb: int) -> None:
        """Pretend something outside the service uses memory on GPU `index`."""
        if not 0 <= free_mb <= self.total_mb[index]:
            raise ValueError(f"free_mb {free_mb} is outside 0..{self.total_mb[index]}")
        self.free_mb[index] = free_mb

    def set_process(self, pid: int, used_mb: int | None) -> None:
        """Report `used_mb` for `pid`; None removes the pid."""
        if used_mb is None:
            self.processes.pop(pid, None)
        else:
            self.processes[pid] = used_mb

    def snapshot(self) -> list[gpu.Gpu]:
        """The fake GPUs as they are now."""
        self._check_open()
        self.snapshots += 1
        return [
            gpu.Gpu(
                index=i,
                name=f"fake-{i}",
                uuid=f"GPU-fake-{i}",
                total_mb=total,
                free_mb=self.free_mb[i],
                virtual=False,
            )
            for i, total in enumerate(self.total_mb)
        ]

    def process_memory_mb(self) -> dict[int, int]:
        """A copy of the per-pid usage set by the test."""
        self._check_open()
        return dict(self.processes)

    def close(self) -> None:
        """Mark the inventory closed; later reads raise."""
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("FakeInventory used after close()")


_: type[gpu.GpuInventory] = FakeInventory  # mypy checks that the fake keeps up with the Protocol
