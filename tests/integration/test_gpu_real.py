"""On a real NVIDIA GPU: placement, VRAM-fit packing without running out of memory, memory taken
outside the service, a warm runner's memory held and given back, and relief on CUDA.

Every test here is marked `gpu` and skips without NVML or without PyTorch seeing CUDA, so CI (no
GPU) skips them all. The models really allocate GPU memory (tests/models/cuda_hog.py); CUDA is
never touched in the test process itself, which would put its own context on the GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app import errors, gpu, modelsfile
from app.queue.jobs import JobState
from tests.conftest import HERE
from tests.integration.test_durability import EXPIRE_LEASE, alive, running, until
from tests.integration.test_worker import enqueue, peak_overlap, trace
from tests.unit.test_relief import load_mesh, run_relief

pytestmark = pytest.mark.gpu

HOG = HERE / "models" / "cuda_hog.py"
BUFFER_MB = 1024  # the worker's vram_buffer_mb in these tests
SLACK_MB = 2048  # a job declares this much more than it allocates: CUDA context and allocator


@pytest.fixture(scope="module")
def nvml() -> Iterator[gpu.NvmlInventory]:
    """The real GPUs, or a skip."""
    try:
        inventory = gpu.NvmlInventory()
    except errors.AppError as exc:
        pytest.skip(f"NVML unavailable: {exc.message}")
    if inventory.device_count == 0:
        inventory.close()
        pytest.skip("NVML sees no GPU")
    yield inventory
    inventory.close()


@pytest.fixture(scope="module")
def cuda(nvml: gpu.NvmlInventory) -> None:
    """Skip unless PyTorch in a child process sees CUDA (this process keeps off the GPU)."""
    probe = "import torch; print(torch.cuda.is_available())"
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if seen.stdout.strip() != "True":
        pytest.skip(f"PyTorch sees no CUDA device here: {seen.stdout.strip()} {seen.stderr[-300:]}")


@pytest.fixture
def models_file(models_file: Path, tmp_path: Path) -> Path:
    """The test models and `hog`, a one-shot model that holds `hold_mb` of GPU memory for `sleep` s."""
    argv = [
        "{python}", str(HOG), "--input", "{input}", "--output-dir", "{output_dir}",
        "--hold-mb", "{hold_mb}", "--sleep", "{sleep}", "--trace", str(tmp_path / "hog.jsonl"),
    ]  # fmt: skip
    with models_file.open("a") as f:
        f.write(hog_model("hog", f"argv = {json.dumps(argv)}", need_mb=1000))
    return models_file


def hog_model(name: str, run: str, *, need_mb: int) -> str:
    """Registry TOML for a cuda_hog model; `run` is its argv (or mode and serve_argv) line(s)."""
    return f"""
[models.{name}]
description = "Test model: holds GPU memory"
{run}
vram = {{ base_mb = {need_mb} }}
timeout_s = 120
max_attempts = 1
[models.{name}.params.hold_mb]
type = "int"
default = 0
[models.{name}.params.sleep]
type = "float"
default = 0.0
[[models.{name}.outputs]]
name = "out.txt"
media_type = "text/plain"
"""


def free_mb(nvml: gpu.NvmlInventory) -> int:
    return nvml.snapshot()[0].free_mb


async def runner_pid(manager: Any, job_id: Any) -> int:
    """The pid of the warm runner that served a job, as its success event says."""
    [detail] = [e.detail for e in await manager.events(job_id) if e.kind == "succeeded"]
    return int(detail["runner_pid"])


def own_gpu(nvml: gpu.NvmlInventory) -> None:
    """Skip on a host with more than one GPU, where placement is tested by test_worker's fakes."""
    if nvml.device_count != 1:
        pytest.skip("written for one GPU")


async def pack(
    manager: Any, make_worker: Any, nvml: gpu.NvmlInventory, tmp_path: Path, fit: int, need: int
) -> None:
    """Queue fit + 2 jobs of `need` MB (`fit` of them fit at once), run them, check the packing."""
    ids = [
        await enqueue(manager, model="hog", vram_mb=need, hold_mb=need - SLACK_MB, sleep=3.0)
        for _ in range(fit + 2)
    ]
    await make_worker(inventory=nvml, vram_buffer_mb=BUFFER_MB).run()
    jobs = [await manager.get(i) for i in ids]
    # No run out of memory (it would be re-queued bigger and succeed later, counting no attempt).
    assert [(j.state, j.error, j.oom_retries) for j in jobs] == [(JobState.succeeded, None, 0)] * len(ids)
    runs = trace(tmp_path / "hog.jsonl")
    [card] = nvml.snapshot()
    assert {r["visible"] for r in runs} == {"0"} and {j.gpu for j in jobs} == {0}
    assert {f"GPU-{r['uuid']}" for r in runs} == {card.uuid}  # CUDA's device 0 is NVML's
    assert {r["held_mb"] for r in runs} == {need - SLACK_MB}
    peak = peak_overlap(runs)
    print(f"{len(ids)} jobs of {need} MB ({need - SLACK_MB} taken) on {card.name}: {fit} fit, {peak} at once")
    assert 2 <= peak <= fit  # packed, never past what fits


async def test_jobs_packed_by_vram_fit_share_the_gpu_without_running_out(
    nvml, cuda, manager, make_worker, tmp_path
):
    own_gpu(nvml)
    await pack(manager, make_worker, nvml, tmp_path, fit=4, need=(free_mb(nvml) - BUFFER_MB) // 4)


async def test_memory_taken_outside_the_service_is_left_to_its_owner(
    nvml, cuda, manager, make_worker, tmp_path
):
    own_gpu(nvml)
    # Another program takes all but room for two jobs of a quarter of the card. Counting only the
    # card's size and the jobs in hand, all four jobs would start at once, and two run out of memory.
    total = nvml.snapshot()[0].total_mb
    need = (total - BUFFER_MB) // 4
    outside_mb = free_mb(nvml) - BUFFER_MB - 2 * need - 1024  # 1024: room for its CUDA context
    holder = await asyncio.create_subprocess_exec(
        *[sys.executable, str(HOG), "--serve", "--hold-mb", str(outside_mb), "--trace", str(tmp_path / "x")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        ready = await asyncio.wait_for(holder.stdout.readline(), timeout=120)
        assert b"ready" in ready, ready
        assert (free_mb(nvml) - BUFFER_MB) // need == 2
        await pack(manager, make_worker, nvml, tmp_path, fit=2, need=need)
        assert holder.returncode is None  # the other program kept its memory all along
    finally:
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        await holder.wait()


async def test_a_warm_runner_holds_real_memory_and_gives_it_back_when_evicted(
    nvml, cuda, manager, make_worker, models_file, tmp_path
):
    own_gpu(nvml)
    free = free_mb(nvml)
    warm_need = free // 2
    warm = [
        "{python}", str(HOG), "--serve", "--hold-mb", str(warm_need - SLACK_MB),
        "--trace", str(tmp_path / "warm.jsonl"),
    ]  # fmt: skip
    with models_file.open("a") as f:
        f.write(
            hog_model(
                "hog_warm",
                'mode = "persistent"\nargv = ["false"]\n'
                f"serve_argv = {json.dumps(warm)}\nload_timeout_s = 120\nidle_vram_mb = {warm_need}",
                need_mb=warm_need,
            )
        )
    # The one-shot job needs more than is left beside the warm runner: it must evict it, and
    # must not start before the runner's memory is really back (else its allocation fails).
    need = free - BUFFER_MB - warm_need // 2
    async with running(make_worker(inventory=nvml, vram_buffer_mb=BUFFER_MB, burst=False)):
        first = await enqueue(manager, model="hog_warm", vram_mb=warm_need)
        job = await until(manager, first, lambda j: j.state.final, timeout_s=120)
        assert job.state is JobState.succeeded, job.error
        runner = await runner_pid(manager, first)
        assert alive(runner)
        held = nvml.process_memory_mb()
        assert held.get(runner, 0) >= warm_need - SLACK_MB, held  # idle, still holding its model
        big = await enqueue(manager, model="hog", vram_mb=need, hold_mb=need - SLACK_MB, sleep=0.5)
        job = await until(manager, big, lambda j: j.state.final, timeout_s=120)
        assert (job.state, job.error, job.oom_retries) == (JobState.succeeded, None, 0)
        assert not alive(runner) and runner not in nvml.process_memory_mb()
    [run] = trace(tmp_path / "hog.jsonl")
    assert run["held_mb"] == need - SLACK_MB


async def test_a_lost_job_claimed_again_waits_for_its_old_runs_memory(
    nvml, cuda, manager, make_worker, engine, tmp_path
):
    """The worker loses a running job's lease and claims the job again: the old run is stopped,
    and the new one must not start before the old run's memory is back (they cannot both fit)."""
    own_gpu(nvml)
    need = (free_mb(nvml) - BUFFER_MB) * 3 // 5
    job_id = await enqueue(manager, model="hog", vram_mb=need, hold_mb=need - SLACK_MB, sleep=8.0)
    worker = make_worker(inventory=nvml, vram_buffer_mb=BUFFER_MB, burst=False, lease_s=60)
    async with running(worker):
        job = await until(manager, job_id, lambda j: j.pid is not None, timeout_s=60)
        deadline = time.monotonic() + 60
        while nvml.process_memory_mb().get(job.pid, 0) < need - SLACK_MB:  # the model is loaded
            assert time.monotonic() < deadline, nvml.process_memory_mb()
            await asyncio.sleep(0.1)
        async with engine.begin() as conn:
            await conn.execute(EXPIRE_LEASE, {"id": job_id})
        assert [t.id for t in await manager.fleet.recover_expired(by_worker="test:elsewhere")] == [job_id]
        done = await until(manager, job_id, lambda j: j.state.final, timeout_s=120)
    assert (done.state, done.error, done.attempt, done.oom_retries) == (JobState.succeeded, None, 2, 0)
    assert [r["job"] for r in trace(tmp_path / "hog.jsonl")] == [f"{job_id}:2"]


def relief_source(path: Path) -> Path:
    """A 320x200 grey picture with rings, so the mesh has detail to get wrong."""
    y, x = np.mgrid[0:200, 0:320]
    rings = 127.5 + 127.5 * np.sin(np.hypot(x - 160, y - 100) / 9.0)
    Image.fromarray(rings.astype(np.uint8), "L").save(path)
    return path


def test_relief_on_cuda_gives_the_mesh_the_cpu_gives(nvml, cuda, tmp_path):
    source = relief_source(tmp_path / "rings.png")
    on_cpu = run_relief(source, tmp_path / "cpu", "--resolution", "256", device="cpu")
    on_gpu = run_relief(source, tmp_path / "cuda", "--resolution", "256", device="cuda")
    assert on_cpu.returncode == 0, on_cpu.stderr
    assert on_gpu.returncode == 0, on_gpu.stderr
    assert "device cuda (torch " in on_gpu.stderr and nvml.snapshot()[0].name in on_gpu.stderr
    a, b = load_mesh(tmp_path / "cpu" / "mesh.glb"), load_mesh(tmp_path / "cuda" / "mesh.glb")
    assert np.array_equal(a.faces, b.faces)
    np.testing.assert_allclose(a.vertices, b.vertices, atol=1e-3)  # millimetres


async def test_relief_in_a_warm_runner_on_cuda_loads_once_and_answers_like_the_cpu(
    nvml, cuda, manager, make_worker, settings, store, tmp_path
):
    own_gpu(nvml)
    source = relief_source(tmp_path / "rings.png")
    on_cpu = run_relief(source, tmp_path / "cpu", "--resolution", "256", device="cpu")
    assert on_cpu.returncode == 0, on_cpu.stderr
    spec = modelsfile.load_registry(settings.models_file).get("relief-warm")
    params = spec.validate_params({"resolution": 256})
    ids = [
        await enqueue(manager, model="relief-warm", vram_mb=spec.base_mb, image=source.read_bytes(), **params)
        for _ in range(3)
    ]
    # One job at a time, so that one runner answers all three (else a runner starts for each).
    worker = make_worker(inventory=nvml, vram_buffer_mb=BUFFER_MB, burst=False, max_jobs_per_gpu=1)
    async with running(worker):
        jobs = [await until(manager, i, lambda j: j.state.final, timeout_s=120) for i in ids]
        assert [(j.state, j.error, j.oom_retries) for j in jobs] == [(JobState.succeeded, None, 0)] * 3
        [runner] = {await runner_pid(manager, i) for i in ids}  # one process, loaded once
        took = [
            (j.finished_at - j.started_at).total_seconds() for j in jobs if j.finished_at and j.started_at
        ]
        print("relief-warm on CUDA, seconds per job (the first loads the model):", took)
        deadline = time.monotonic() + 10
        while runner not in nvml.process_memory_mb():  # its CUDA context is on the GPU
            assert time.monotonic() < deadline, nvml.process_memory_mb()
            await asyncio.sleep(0.2)
    expected = load_mesh(tmp_path / "cpu" / "mesh.glb")
    for job in jobs:
        got = load_mesh(store.resolve(job, "mesh.glb")[0])
        assert np.array_equal(got.faces, expected.faces)
        np.testing.assert_allclose(got.vertices, expected.vertices, atol=1e-3)
