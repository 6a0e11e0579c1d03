"""API keys and the request-level security helpers, without a database."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest

from app import auth, errors
from app.api import security
from app.settings import Settings

APP = Path(__file__).resolve().parents[2] / "app"


def test_keys_are_random_urlsafe_and_at_least_32_bytes() -> None:
    keys = {auth.generate() for _ in range(1000)}
    assert len(keys) == 1000
    for key in list(keys)[:50]:
        assert key.startswith(auth.KEY_PREFIX) and auth.well_formed(key)
        body = key.removeprefix(auth.KEY_PREFIX)
        assert len(body) * 6 >= 256  # base64url: 6 bits a character, 32 bytes or more
    # Every character position varies: the key is not a counter or a timestamp.
    assert all(len({k[i] for k in keys}) > 10 for i in range(len(auth.KEY_PREFIX), 40))


def test_the_stored_form_is_the_sha256_of_the_key() -> None:
    key = auth.generate()
    assert auth.hash_key(key) == hashlib.sha256(key.encode()).hexdigest()
    assert auth.hash_key(key) != auth.hash_key(key[:-1] + "x")
    assert key not in auth.hash_key(key)


@pytest.mark.parametrize(
    "candidate",
    ["", "gpj_", "key", "gpj_" + "a" * 200, "gpj_abc def", "gpj_abc\n", "gpj_ünïcode", "Bearer gpj_abc"],
)
def test_malformed_keys_are_refused_before_any_lookup(candidate: str) -> None:
    assert not auth.well_formed(candidate)


@pytest.mark.parametrize("name", ["alice", "bob.smith@example.com", "team-7", "svc_ci+deploy", "a" * 64])
def test_principal_names(name: str) -> None:
    assert auth.check_principal(name) == name


@pytest.mark.parametrize("name", ["", " alice", "a" * 65, "../etc", "alice bob", "-flag", "名前", "a\nb"])
def test_bad_principal_names_are_refused(name: str) -> None:
    with pytest.raises(errors.InvalidRequest, match="principal"):
        auth.check_principal(name)


def test_identity_roles() -> None:
    assert auth.Identity(1, "root", auth.Role.admin).admin
    assert not auth.Identity(2, "alice", auth.Role.user).admin
    assert auth.Unauthorized().status_code == 401


def test_auth_is_domain_code_without_the_web_framework() -> None:
    tree = ast.parse((APP / "auth.py").read_text())
    imported = {
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
    }
    assert not any(name.split(".")[0] in {"fastapi", "starlette"} for name in imported), imported


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("Bearer abc", "abc"),
        ("bearer   abc ", "abc"),
        ("BEARER abc", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer    ", None),
        ("abc", None),
    ],
)
def test_bearer_token_parsing(header: str | None, token: str | None) -> None:
    headers = [] if header is None else [(b"authorization", header.encode())]
    assert security.bearer_token({"type": "http", "headers": headers}) == token


def test_public_paths_follow_the_settings() -> None:
    from fastapi import FastAPI

    app = FastAPI()
    default = security.public_paths(app, Settings())
    assert {"/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"} <= default
    closed = security.public_paths(app, Settings(public_metrics=False, public_docs=False))
    assert closed == {"/healthz", "/readyz"}
    guard = security.Authenticate(app, public=closed)
    assert guard.is_public("/files/123/out.txt")
    assert not guard.is_public("/files")
    assert not guard.is_public("/jobs")
    assert not guard.is_public("/healthz/../jobs")
