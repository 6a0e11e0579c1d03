"""docs/operations.md's examples and tables of what the API serves, against what it serves."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import api_client
from tests.integration.test_durability import running
from tests.integration.test_stream import submit_toy

ROOT = Path(__file__).resolve().parents[2]
OPS_DOC = (ROOT / "docs" / "operations.md").read_text()


def part(heading: str) -> str:
    """The doc's text under `heading` (a `## ` line), up to the next such heading."""
    return OPS_DOC.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def shape(value: Any) -> Any:
    """The keys of a JSON value, nested (a list by its first item), without the values."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


async def ready_with_a_worker(http: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while (ready := await http.get("/readyz")).json().get("workers") != 1:
        assert time.monotonic() < deadline, ready.text
        await asyncio.sleep(0.1)
    assert ready.status_code == 200
    return ready.json()


async def test_the_readyz_example_of_docs_operations_has_the_fields_readyz_answers(settings, make_worker):
    """docs/operations.md's /readyz example showed `schema` as {"current", "head"}, while /readyz
    answers `oldest_code` too (the field "Upgrading" tells operators to read): a probe or a check
    written from the example does not know it."""
    example = json.loads(re.search(r"```json\n(.*?)```", part("## Health"), re.S)[1])
    async with api_client(settings, key=None) as http, running(make_worker(burst=False)):
        answered = await ready_with_a_worker(http)
    assert shape(example) == shape(answered)


SERIES_ROW = re.compile(r"^\| `(gpujobs_\w+)` \| (counter|gauge|histogram) \|([a-z, ]*)\|", re.M)


async def test_every_series_docs_operations_lists_is_served_with_its_type_and_labels(settings, make_worker):
    """The table of series in docs/operations.md, "The series", against a scrape of an API with a
    worker heartbeating: each row's name is served, of its type, with exactly its labels (where it
    has samples), and every gpujobs_ series served is in the table."""
    rows = {name: (kind, {label.strip() for label in labels.split(",") if label.strip()})
            for name, kind, labels in SERIES_ROW.findall(part("## Metrics (`GET /metrics`)"))}  # fmt: skip
    assert len(rows) > 20, "the table of series was not found"
    async with api_client(settings, metrics_cache_s=0) as http, running(make_worker(burst=False)):
        await ready_with_a_worker(http)
        await submit_toy(http)
        await http.get("/no-such-path")
        response = await http.get("/metrics")
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    served = {name for name in families if name.startswith("gpujobs_")}
    for name, (kind, labels) in rows.items():
        family = families.get(name.removesuffix("_total") if kind == "counter" else name)
        assert family is not None, f"{name} is in the doc's table but not served"
        assert family.type == kind, (name, family.type)
        seen = {label for sample in family.samples for label in sample.labels} - {"le"}
        assert not family.samples or seen == labels, (name, seen, labels)
    documented = {
        name.removesuffix("_total") if kind == "counter" else name for name, (kind, _) in rows.items()
    }
    # prometheus_client's own `_created` series of a histogram is not the service's.
    assert served - documented <= {"gpujobs_http_request_duration_seconds_created"}, served - documented
    http_samples = families["gpujobs_http_request_duration_seconds"].samples
    assert any(s.labels.get("route") == "unmatched" for s in http_samples), "a path no route has"
