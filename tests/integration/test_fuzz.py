"""Schema-driven fuzzing of the whole API with schemathesis, from the app's own OpenAPI document.

Every operation gets generated requests, valid and invalid, as a user, as an admin and without a
key. No answer may be a 5xx, and each must match the document: a documented status code, the
declared content type and the declared response schema. Deterministic (derandomized) and short
enough for CI; `GPUJOBS_FUZZ_EXAMPLES=500` explores further.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.api import connections
from app.api.main import create_app
from app.settings import Settings
from tests.conftest import bearer, create_key, png_bytes

EXAMPLES = int(os.environ.get("GPUJOBS_FUZZ_EXAMPLES", "25"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class ServerThread(threading.Thread):
    """The API under uvicorn in its own thread and event loop (the fuzzer's client is blocking)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(name="fuzzed-api", daemon=True)
        self.settings = settings
        self.keys: dict[str, str] = {}
        self.server: uvicorn.Server | None = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self.failure = exc

    async def _serve(self) -> None:
        url = self.settings.database_url
        assert url
        self.keys = {
            "admin": await create_key(url, "admin", admin=True),
            "alice": await create_key(url, "alice"),
        }
        config = uvicorn.Config(
            create_app(self.settings), host="127.0.0.1", port=0, loop="none", log_level="warning",
            http=connections.protocol(self.settings.client_timeout_s),  # as `gpujobs serve` speaks HTTP
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        await self.server.serve()

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"


@contextlib.contextmanager
def serving(settings: Settings) -> Iterator[ServerThread]:
    """Start the API in a thread; stop it at the end."""
    thread = ServerThread(settings)
    thread.start()
    deadline = time.monotonic() + 30
    while thread.server is None or not thread.server.started:
        assert thread.failure is None and time.monotonic() < deadline, thread.failure
        time.sleep(0.02)
    try:
        yield thread
    finally:
        thread.server.should_exit = True
        thread.join(timeout=30)


def seed(base: str, key: str) -> list[str]:
    """Two real jobs of the user, so that some generated ids and lists are not empty."""
    ids = []
    with requests.Session() as http:
        for i in range(2):
            answer = http.post(
                f"{base}/jobs",
                files={"image": ("a.png", png_bytes(color=(i, 7, 7)), "image/png")},
                data={"model": "toy"},
                headers=bearer(key),
                timeout=30,
            )
            assert answer.status_code == 201, answer.text
            ids.append(answer.json()["id"])
    return ids


def fuzz(operation: Any, base: str, headers: dict[str, str], mode: GenerationMode, session: Any) -> None:
    """Run generated cases of one operation and check every answer."""

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],  # report the first failure unshrunk: CI time
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=base, headers=headers, session=session, timeout=30)
        case.validate_response(response, checks=CHECKS, headers=headers)

    run()


@pytest.mark.slow
def test_fuzz_the_whole_api_finds_no_5xx_and_no_schema_violation(settings: Settings) -> None:
    with serving(settings) as api, requests.Session() as session:
        base = api.base_url
        seed(base, api.keys["alice"])
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 10
        failures = []
        for operation in operations:
            admin = operation.path.startswith("/admin")
            as_whom = {"user": bearer(api.keys["alice"]), "none": {}}
            if admin:
                as_whom["admin"] = bearer(api.keys["admin"])
            for who, headers in as_whom.items():
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    if who == "none" and mode is GenerationMode.NEGATIVE:
                        continue
                    try:
                        fuzz(operation, base, headers, mode, session)
                    except hypothesis.errors.Unsatisfiable:
                        continue  # nothing negative can be made for this operation
                    except (Exception, BaseExceptionGroup) as exc:
                        failures.append(
                            f"{operation.method.upper()} {operation.path} as {who}, {mode}: {exc}"
                        )
        assert failures == [], "\n\n".join(failures)
        assert api.failure is None
