"""The job page's preview card, over plain HTTP, for jobs that have no mesh to show."""

from __future__ import annotations

import re
import uuid

from tests.conftest import api_client
from tests.integration.test_retention import age
from tests.integration.test_stream import submit_toy


def preview_text(html: str) -> str:
    """What the preview card says before (and unless) its script draws a mesh."""
    found = re.search(r'<p class="viewer-empty" id="viewer-empty">\s*(.*?)\s*</p>', html, re.S)
    assert found, html
    return found[1]


async def test_a_succeeded_job_without_a_mesh_does_not_say_it_is_loading_one(settings, make_worker, engine):
    """A job that succeeded without a mesh file (a model whose outputs are not meshes), or whose
    files retention deleted, said "Loading the preview…" for ever: the page's script draws only
    a mesh it has a link to, and changes nothing otherwise."""
    async with api_client(settings, metrics_cache_s=0) as http:
        job_id = await submit_toy(http)  # its one output is out.txt
        await make_worker().run()
        page = await http.get(f"/ui/jobs/{job_id}")
        assert page.status_code == 200 and 'data-mesh-url=""' in page.text
        assert preview_text(page.text) == "This job has no mesh to show."

        await age(engine, uuid.UUID(job_id))
        pruned = await http.post("/admin/prune", json={"older_than_s": 86_400})
        assert pruned.json()["jobs"] == 1
        page = await http.get(f"/ui/jobs/{job_id}")
        assert preview_text(page.text) == "Retention deleted this job's files."
