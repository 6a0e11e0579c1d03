"""GPU inventory: sizes, accounting, placement, NVML reading and the virtual fallback."""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from typing import Any

import pytest

from app import errors, gpu
from tests.fakes import FakeInventory

GIB = 1 << 30
MIB = 1 << 20


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError; `value` is NVML's return code (999: unknown)."""

    def __init__(self, message: str, value: int = 999) -> None:
        super().__init__(message)
        self.value = value


MEMORY_V2 = 0x02000028  # pynvml.nvmlMemory_v2


def fake_pynvml(
    devices: Sequence[tuple[str | bytes, int, int]] = (),
    *,
    processes: Sequence[Sequence[tuple[int, int | None]]] = (),
    init_error: str | None = None,
    reserved: Sequence[int] | None = None,
    v2_error: int | None = None,
) -> types.ModuleType:
    """A module with the slice of pynvml's API that NvmlInventory uses: (name, total, free) bytes.
    With `reserved` (bytes the driver keeps, per device) it has memory info v2 too, which answers
    NVML's error `v2_error` when given (13: the function is missing); v1 counts `reserved` as used.
    While `module.state["failing"]` holds a message, every reading of a device raises it; while
    `module.state["lost"]` maps a device's index to a message, readings of that device raise it."""
    module = types.ModuleType("fake_pynvml")
    state: dict[str, Any] = {"initialised": 0, "shutdown": 0, "failing": None, "lost": {}, "v2_calls": 0}

    def reading(index: int) -> None:
        if state["failing"] is not None:
            raise FakeNvmlError(state["failing"])
        if index in state["lost"]:
            raise FakeNvmlError(state["lost"][index])

    def init() -> None:
        if init_error is not None:
            raise FakeNvmlError(init_error)
        state["initialised"] += 1

    def shutdown() -> None:
        state["shutdown"] += 1

    def memory(index: int, version: int | None = None) -> types.SimpleNamespace:
        _, total, free = devices[index]
        if version is None:
            reading(index)
            return types.SimpleNamespace(total=total, free=free, used=total - free)
        assert reserved is not None and version == MEMORY_V2
        state["v2_calls"] += 1
        if v2_error is not None:
            raise FakeNvmlError("Function Not Found", v2_error)
        reading(index)
        held = reserved[index]
        return types.SimpleNamespace(total=total, reserved=held, free=free, used=total - held - free)

    def procs(index: int) -> list[types.SimpleNamespace]:
        reading(index)
        listed = processes[index] if index < len(processes) else ()
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in listed]

    module.__dict__.update(
        NVMLError=FakeNvmlError,
        state=state,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda index: devices[index][0],
        nvmlDeviceGetUUID=lambda index: f"GPU-{index:04d}".encode(),
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetComputeRunningProcesses=procs,
    )
    if reserved is not None:
        module.nvmlMemory_v2 = MEMORY_V2
    return module


def gpu_of(total_mb: int, free_mb: int) -> gpu.Gpu:
    return gpu.Gpu(index=0, name="g", uuid="u", total_mb=total_mb, free_mb=free_mb, virtual=False)


def warnings_from(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "gpujobs.gpu" and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("24GiB,24GiB", [24_576, 24_576]),
        ("10GB", [10_240]),
        ("8000MB", [8000]),
        ("8000MiB", [8000]),
        ("8000", [8000]),
        ("1.5GiB", [1536]),
        (" 2 gib , 512mb ", [2048, 512]),
        ("1TiB", [1_048_576]),
    ],
)
def test_parse_sizes_accepts(text: str, sizes: list[int]) -> None:
    assert gpu.parse_sizes(text) == sizes


@pytest.mark.parametrize(
    ("text", "bad_item"),
    [
        ("", "''"),
        ("24GiB,", "''"),
        ("24GiB,lots", "'lots'"),
        ("24 GiBs", "'24 GiBs'"),
        ("-5GB", "'-5GB'"),
        ("0", "'0'"),
        ("0.0001MB", "'0.0001MB'"),
        ("1e3MB", "'1e3MB'"),
        ("nan", "'nan'"),
    ],
)
def test_parse_sizes_rejects_naming_the_item(text: str, bad_item: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        gpu.parse_sizes(text)
    assert bad_item in caught.value.message
    assert "GPUJOBS_GPUS" in caught.value.message


def test_available_uses_accounting_when_nvml_agrees() -> None:
    assert gpu.available_mb(gpu_of(24_000, 24_000), reserved_mb=10_000, buffer_mb=500) == 13_500


def test_available_uses_nvml_free_when_it_is_lower() -> None:
    # Something outside the service holds 20 GB: accounting alone would say 13.5 GB.
    assert gpu.available_mb(gpu_of(24_000, 4_000), reserved_mb=10_000, buffer_mb=500) == 3_500


def test_available_is_never_negative() -> None:
    assert gpu.available_mb(gpu_of(24_000, 100), reserved_mb=0, buffer_mb=500) == 0
    assert gpu.available_mb(gpu_of(24_000, 24_000), reserved_mb=30_000, buffer_mb=0) == 0


def test_fits_is_inclusive() -> None:
    assert gpu.fits(1000, 1000)
    assert not gpu.fits(1001, 1000)


def test_place_picks_the_tightest_fit() -> None:
    assert gpu.place(4000, {0: 20_000, 1: 5_000, 2: 3_000, 3: 8_000}) == 1


def test_place_breaks_ties_by_lowest_index() -> None:
    assert gpu.place(4000, {3: 5_000, 1: 5_000, 2: 9_000}) == 1


def test_place_returns_none_when_nothing_fits() -> None:
    assert gpu.place(40_000, {0: 20_000, 1: 5_000}) is None
    assert gpu.place(1, {}) is None


def test_virtual_inventory() -> None:
    inventory = gpu.VirtualInventory([1000, 2000])
    assert inventory.snapshot() == [
        gpu.Gpu(index=0, name="virtual-0", uuid="virtual-0", total_mb=1000, free_mb=1000, virtual=True),
        gpu.Gpu(index=1, name="virtual-1", uuid="virtual-1", total_mb=2000, free_mb=2000, virtual=True),
    ]
    assert inventory.process_memory_mb() == {}
    inventory.close()


def test_virtual_inventory_rejects_empty_gpus() -> None:
    with pytest.raises(errors.ConfigError):
        gpu.VirtualInventory([1000, 0])


def test_nvml_inventory_reads_devices_and_processes() -> None:
    module = fake_pynvml(
        [(b"NVIDIA H100", 80 * GIB, 70 * GIB), ("NVIDIA L4", 24 * GIB, 24 * GIB - 1)],
        processes=[[(11, GIB), (12, None)], [(11, GIB + 1)]],
    )
    inventory = gpu.NvmlInventory(module)
    first, second = inventory.snapshot()
    assert first == gpu.Gpu(0, "NVIDIA H100", "GPU-0000", 81_920, 71_680, False)
    assert (second.name, second.uuid, second.free_mb) == ("NVIDIA L4", "GPU-0001", 24_575)
    # Usage rounds up per GPU; a pid whose usage NVML cannot tell is left out.
    assert inventory.process_memory_mb() == {11: 1024 + 1025}
    inventory.close()
    inventory.close()
    assert module.state["shutdown"] == 1
    with pytest.raises(errors.AppError, match="closed"):
        inventory.snapshot()


def test_a_gpus_size_leaves_out_the_drivers_reserve() -> None:
    """NVML's memory info v1 counts the driver's reserve as used, so an idle GPU never showed its
    total free: a job sized between the two was taken (the API's intake compares with the size),
    or grown there after running out of memory, and never fitted. Read with v2, the size is what
    programs can have, and an idle GPU shows all of it free."""
    module = fake_pynvml(
        [("NVIDIA A100", 40 * GIB, 40 * GIB - 912 * MIB), ("NVIDIA A100", 40 * GIB, 30 * GIB)],
        reserved=[912 * MIB, 912 * MIB],
    )
    idle, busy = gpu.NvmlInventory(module).snapshot()
    assert (idle.total_mb, idle.free_mb) == (40_960 - 912, 40_960 - 912)
    assert (busy.total_mb, busy.free_mb) == (40_960 - 912, 30_720)


@pytest.mark.parametrize("code", [3, 13, 25])  # not supported, function not found, version mismatch
def test_a_driver_without_memory_info_v2_is_read_with_v1_from_then_on(
    code: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpujobs.gpu")
    module = fake_pynvml([("Tesla T4", 16 * GIB, 15 * GIB)], reserved=[300 * MIB], v2_error=code)
    inventory = gpu.NvmlInventory(module)
    for _ in range(3):
        [read] = inventory.snapshot()
        assert (read.total_mb, read.free_mb, read.error) == (16_384, 15_360, None)
    assert module.state["v2_calls"] == 1
    assert [r.getMessage() for r in caplog.records][-1].startswith("NVML has no memory info v2")


def test_bindings_that_name_memory_info_v2_but_take_no_version_are_read_with_v1() -> None:
    module = fake_pynvml([("Tesla T4", 16 * GIB, 15 * GIB)], reserved=[300 * MIB])
    v1 = module.nvmlDeviceGetMemoryInfo
    module.nvmlDeviceGetMemoryInfo = lambda handle: v1(handle)  # an older signature
    [read] = gpu.NvmlInventory(module).snapshot()
    assert (read.total_mb, read.free_mb, read.error) == (16_384, 15_360, None)


def test_another_error_of_memory_info_v2_is_the_gpus_not_the_drivers() -> None:
    """A GPU fallen off the bus answers v2 with its error: that GPU is shown unreadable, and v2 is
    kept for the others (not taken for a driver without it)."""
    module = fake_pynvml(
        [("NVIDIA L4", 24 * GIB, 20 * GIB), ("NVIDIA L4", 24 * GIB, 24 * GIB - 100 * MIB)],
        reserved=[100 * MIB, 100 * MIB],
    )
    inventory = gpu.NvmlInventory(module)
    module.state["lost"] = {0: "GPU is lost"}
    lost, other = inventory.snapshot()
    assert lost.error == "NVML: reading memory of GPU 0 failed: GPU is lost"
    assert (other.total_mb, other.free_mb) == (24_476, 24_476)
    assert module.state["v2_calls"] == 2


def test_a_gpu_nvml_cannot_read_is_listed_full_while_the_others_are_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A GPU fallen off the bus made every reading raise, so a worker with eight GPUs stopped
    claiming for all of them until it was restarted. Now only that GPU is shown full (0 MB free,
    with NVML's error), and said so once per outage; the reading raises only when no GPU answers."""
    caplog.set_level(logging.INFO, logger="gpujobs.gpu")
    module = fake_pynvml(
        [("NVIDIA L4", 24 * GIB, 20 * GIB), ("NVIDIA L4", 24 * GIB, 24 * GIB)],
        processes=[[(11, GIB)], [(12, 2 * GIB)]],
    )
    inventory = gpu.NvmlInventory(module)
    assert [g.free_mb for g in inventory.snapshot()] == [20_480, 24_576]
    module.state["lost"] = {0: "GPU is lost"}
    for _ in range(3):
        lost, other = inventory.snapshot()
        assert (lost.total_mb, lost.free_mb) == (24_576, 0)
        assert lost.error == "NVML: reading memory of GPU 0 failed: GPU is lost"
        assert (other.free_mb, other.error) == (24_576, None)
        assert inventory.process_memory_mb() == {12: 2048}
    assert warnings_from(caplog) == ["GPU 0 could not be read; no job is placed on it: GPU is lost"]
    module.state["lost"] = {0: "GPU is lost", 1: "GPU is lost"}
    with pytest.raises(errors.AppError, match="GPU 0 failed: GPU is lost"):
        inventory.snapshot()
    with pytest.raises(errors.AppError, match="GPU 0 failed: GPU is lost"):
        inventory.process_memory_mb()
    module.state["lost"] = {}
    assert [(g.free_mb, g.error) for g in inventory.snapshot()] == [(20_480, None), (24_576, None)]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO][-1] == "GPU 0 read again"


def test_nvml_init_failure_is_translated() -> None:
    with pytest.raises(errors.AppError, match="Driver Not Loaded"):
        gpu.NvmlInventory(fake_pynvml(init_error="Driver Not Loaded"))


def test_detect_prefers_nvml_and_warns_that_the_setting_is_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = fake_pynvml([("NVIDIA L4", 24 * GIB, 24 * GIB)])
    inventory = gpu.detect_inventory("8GiB", 4096, nvml=module)
    assert isinstance(inventory, gpu.NvmlInventory)
    assert [g.virtual for g in inventory.snapshot()] == [False]
    assert len(warnings_from(caplog)) == 1
    assert "ignored" in warnings_from(caplog)[0]


def test_detect_falls_back_when_nvml_sees_no_gpu(caplog: pytest.LogCaptureFixture) -> None:
    module = fake_pynvml([])
    inventory = gpu.detect_inventory(None, 4096, nvml=module)
    assert [g.total_mb for g in inventory.snapshot()] == [4096]
    assert module.state["shutdown"] == 1
    assert len(warnings_from(caplog)) == 1
    assert "NVML sees no GPU" in warnings_from(caplog)[0]
    assert "from GPUJOBS_VIRTUAL_GPU_MB: 4096 MB" in warnings_from(caplog)[0]  # the setting to change


def test_detect_falls_back_to_configured_sizes(caplog: pytest.LogCaptureFixture) -> None:
    module = fake_pynvml(init_error="NVML Shared Library Not Found")
    inventory = gpu.detect_inventory("24GiB,8000", 4096, nvml=module)
    assert [(g.total_mb, g.virtual) for g in inventory.snapshot()] == [(24_576, True), (8000, True)]
    [line] = warnings_from(caplog)
    assert "NVML Shared Library Not Found" in line
    assert "GPUJOBS_GPUS" in line


def test_detect_rejects_a_bad_setting_even_with_nvml() -> None:
    with pytest.raises(errors.ConfigError, match="'huge'"):
        gpu.detect_inventory("huge", 4096, nvml=fake_pynvml([("NVIDIA L4", GIB, GIB)]))


FOUR = [("NVIDIA L4", 24 * GIB, 24 * GIB)] * 4  # fake_pynvml names them GPU-0000 .. GPU-0003


@pytest.mark.parametrize(
    ("visible", "chosen"),
    [("1", [1]), ("3,1", [1, 3]), (" 2 , 0 ", [0, 2]), ("GPU-0002", [2]), ("gpu-0003,0", [0, 3])],
)
def test_cuda_visible_devices_narrows_the_worker_to_its_group(visible: str, chosen: list[int]) -> None:
    """A worker started with CUDA_VISIBLE_DEVICES (one per group of GPUs on a host) listed every
    GPU all the same, and gave its jobs NVML's index of whichever it placed them on: two such
    workers shared every GPU, each blind to the other's jobs. Now it uses the GPUs named, by NVML's
    index (PCI bus order) or UUID, and keeps their indexes, which its jobs are given."""
    inventory = gpu.detect_inventory(None, 4096, nvml=fake_pynvml(FOUR), visible=visible)
    assert [(g.index, g.uuid) for g in inventory.snapshot()] == [(i, f"GPU-{i:04d}") for i in chosen]


@pytest.mark.parametrize(
    ("visible", "why"),
    [
        ("4", "'4' matches no single GPU"),
        ("1,1", "'1' names a GPU twice"),
        ("GPU-000", "'GPU-000' matches no single GPU"),  # a prefix of every UUID here
        ("MIG-1", "'MIG-1' matches no single GPU"),
        ("0,,1", "'' matches no single GPU"),
    ],
)
def test_cuda_visible_devices_that_names_no_gpu_stops_the_worker_saying_which(visible: str, why: str) -> None:
    module = fake_pynvml(FOUR)
    with pytest.raises(errors.ConfigError) as caught:
        gpu.detect_inventory(None, 4096, nvml=module, visible=visible)
    assert why in caught.value.message and "GPUs here: 0: GPU-0000, 1: GPU-0001" in caught.value.message
    assert module.state["shutdown"] == 1


@pytest.mark.parametrize("visible", ["", "-1"])
def test_cuda_visible_devices_that_hides_every_gpu_gives_the_virtual_fallback(
    visible: str, caplog: pytest.LogCaptureFixture
) -> None:
    inventory = gpu.detect_inventory(None, 4096, nvml=fake_pynvml(FOUR), visible=visible)
    assert [g.virtual for g in inventory.snapshot()] == [True]
    assert f"CUDA_VISIBLE_DEVICES={visible!r} names none" in warnings_from(caplog)[0]


def test_detect_falls_back_on_this_host(caplog: pytest.LogCaptureFixture) -> None:
    """The real pynvml: a host without a driver gets the default virtual GPU and one warning."""
    try:
        gpu.NvmlInventory().close()
    except errors.AppError:
        pass
    else:
        pytest.skip("NVML works on this host")
    inventory = gpu.detect_inventory(None, 24_576)
    assert [(g.name, g.total_mb, g.free_mb) for g in inventory.snapshot()] == [("virtual-0", 24_576, 24_576)]
    [line] = warnings_from(caplog)
    assert "virtual" in line


def test_fake_inventory_follows_the_test() -> None:
    inventory: gpu.GpuInventory = FakeInventory([8000, 16_000])
    assert isinstance(inventory, FakeInventory)
    inventory.set_free(1, 1000)
    inventory.set_process(42, 700)
    assert [g.free_mb for g in inventory.snapshot()] == [8000, 1000]
    assert inventory.process_memory_mb() == {42: 700}
    inventory.set_process(42, None)
    assert inventory.process_memory_mb() == {}


@pytest.mark.gpu
def test_nvml_on_a_real_gpu() -> None:
    """Needs an NVIDIA driver: reads real devices and compute processes."""
    try:
        inventory = gpu.NvmlInventory()
    except errors.AppError as exc:
        pytest.skip(f"NVML unavailable: {exc.message}")
    try:
        if inventory.device_count == 0:
            pytest.skip("NVML sees no GPU")
        gpus = inventory.snapshot()
        assert [g.index for g in gpus] == list(range(len(gpus)))
        for device in gpus:
            assert device.name and device.uuid.startswith(("GPU-", "MIG-"))
            assert 0 <= device.free_mb <= device.total_mb
            assert not device.virtual
        usage = inventory.process_memory_mb()
        assert all(pid > 0 and mb >= 0 for pid, mb in usage.items())
        # With no process on them, GPUs offer (nearly) their whole size: the driver's reserve is
        # not in it (memory info v2).
        for device in gpus if not usage else []:
            assert device.total_mb - device.free_mb <= IDLE_SLACK_MB, device
    finally:
        inventory.close()


# What an idle GPU may show in use beyond the driver's reserve (NVML's own bookkeeping).
IDLE_SLACK_MB = 64
