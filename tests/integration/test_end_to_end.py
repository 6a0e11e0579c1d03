"""Whole paths through real processes: HTTP upload → worker → relief → signed download."""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid

import httpx
import trimesh
from PIL import Image
from sqlalchemy import text

from app.queue.jobs import JobState
from tests.conftest import api_client
from tests.integration.test_worker import enqueue, trace


async def wait_for(client: httpx.AsyncClient, job_id: str, states: set[str], timeout_s: float = 60) -> dict:
    """Poll the job until it reaches one of `states`."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = (await client.get(f"/jobs/{job_id}")).json()
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, f"job stuck in {job['state']}: {job}"
        await asyncio.sleep(0.1)


def gradient_png(width: int, height: int) -> bytes:
    """A horizontal brightness ramp: a relief that rises left to right."""
    image = Image.new("L", (width, height))
    image.putdata([int(255 * x / (width - 1)) for _ in range(height) for x in range(width)])
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


async def test_upload_relief_and_download_a_watertight_glb(settings, tmp_path):
    async with api_client(settings, run_worker=True) as http:
        params = {"width_mm": 80, "depth_mm": 6, "base_mm": 2, "resolution": 64}
        response = await http.post(
            "/jobs",
            files={"image": ("ramp.png", gradient_png(160, 80), "image/png")},
            data={"model": "relief", "params": json.dumps(params)},
        )
        assert response.status_code == 201, response.text
        job = await wait_for(http, response.json()["id"], {"succeeded", "failed"})
        assert job["state"] == "succeeded", job["error"]
        assert job["progress"] == 1 and job["attempt"] == 1
        [mesh_file] = job["files"]
        assert mesh_file["name"] == "mesh.glb" and mesh_file["media_type"] == "model/gltf-binary"

        download = await http.get(mesh_file["url"])
        assert download.status_code == 200
        assert download.headers["content-type"] == "model/gltf-binary"
        assert 'filename="mesh.glb"' in download.headers["content-disposition"]
        assert download.headers["etag"] == f'"{mesh_file["sha256"]}"'
        assert len(download.content) == mesh_file["bytes"]
        log = await http.get(job["links"]["log"])
        assert log.status_code == 200 and "PROGRESS" in log.text

    path = tmp_path / "mesh.glb"
    path.write_bytes(download.content)
    mesh = trimesh.load(path, force="mesh")
    assert mesh.is_watertight
    extents = mesh.bounds[1] - mesh.bounds[0]
    assert abs(extents[0] - 80) < 0.01  # the longer side is width_mm
    assert abs(extents[1] - 40) < 0.01  # aspect ratio kept
    assert abs(mesh.bounds[0][2]) < 1e-6 and abs(mesh.bounds[1][2] - 8) < 0.01  # base + depth


async def test_signed_links_range_tamper_and_expiry(settings, manager, make_worker):
    job_id = await enqueue(manager)
    await make_worker().run()
    async with api_client(settings) as http:
        job = (await http.get(f"/jobs/{job_id}")).json()
        url = job["files"][0]["url"]
        whole = await http.get(url)
        assert whole.status_code == 200 and whole.text == f"done {job_id}:1\n"
        part = await http.get(url, headers={"Range": "bytes=0-3"})
        assert part.status_code == 206 and part.content == b"done"
        same = await http.get(url, headers={"If-None-Match": whole.headers["etag"]})
        assert same.status_code == 304

        assert (await http.get(url[:-2] + ("AA" if not url.endswith("AA") else "BB"))).status_code == 403
        other_name = url.replace("/out.txt?", "/attempt-1.log?")
        assert (await http.get(other_name)).status_code == 403  # the signature binds the name
        other_job = url.replace(str(job_id), str(uuid.uuid4()))
        assert (await http.get(other_job)).status_code == 403  # ... and the job
        later = url.replace("exp=", "exp=9")
        assert (await http.get(later)).status_code == 403  # ... and the expiry

        signer = http.app.state.services.signer
        expired = signer.url(job_id, "out.txt", now=time.time() - 2 * signer.ttl_s)
        refused = await http.get(expired)
        assert refused.status_code == 403 and "expired" in refused.json()["detail"]
        not_a_result = signer.url(job_id, "../../link_secret")
        assert (await http.get(not_a_result)).status_code == 404


async def test_two_worker_processes_run_200_jobs_once_each(settings, manager, spawn_worker, engine, tmp_path):
    log = tmp_path / "trace.jsonl"
    ids = [await enqueue(manager, steps=0, trace=str(log)) for _ in range(200)]
    workers = [spawn_worker(f"p{i}", "--burst", max_jobs_per_gpu=8) for i in range(2)]
    for process in workers:
        assert await asyncio.to_thread(process.wait, 120) == 0
    runs = trace(log)
    assert sorted(r["job"] for r in runs) == sorted(f"{i}:1" for i in ids)  # each job ran once, attempt 1
    async with engine.connect() as conn:
        states = dict((await conn.execute(text("SELECT state, count(*) FROM jobs GROUP BY state"))).all())
        by_worker = dict(
            (await conn.execute(text("SELECT worker_id, count(*) FROM jobs GROUP BY worker_id"))).all()
        )
    assert states == {JobState.succeeded.value: 200}
    assert len(by_worker) == 2, by_worker  # both processes took part
