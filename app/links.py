"""Signed, expiring download links: /files/<job>/<name>?exp=<unix time>&sig=<hmac>.

The signature binds the job id, the file name and the expiry, so none can be changed. The secret
comes from settings or is generated once into the storage folder (never from the repository).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import secrets
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote

from app import errors, storage

MIN_SECRET_CHARS = 16


def load_or_create_secret(storage_dir: Path) -> bytes:
    """The link secret kept in `storage_dir/link_secret`, created (0600) on first use.

    The secret is written to a file of its own first, flushed, and linked into place whole, so a process
    starting beside another never reads the file created but not yet written."""
    path = storage_dir / "link_secret"
    try:
        secret = _read_or_create(storage_dir, path)
    except OSError as exc:  # a folder in the way, a file this user cannot read
        raise storage.unusable(path, exc) from exc
    if len(secret) < MIN_SECRET_CHARS:  # cut by hand, or copied wrong: the operator set no secret
        raise errors.ConfigError(
            f"the link secret file {path} holds {len(secret)} characters, fewer than "
            f"{MIN_SECRET_CHARS}: delete it and a new one is made at the next start "
            "(links signed with the old one stop working)"
        )
    return secret


def _read_or_create(storage_dir: Path, path: Path) -> bytes:
    storage_dir.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd, draft = tempfile.mkstemp(prefix=".link_secret.", dir=storage_dir)  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_urlsafe(48).encode())
                f.flush()
                os.fsync(f.fileno())  # on disk before its name: a power cut leaves no empty secret
            with contextlib.suppress(FileExistsError):  # another process was first: its secret holds
                os.link(draft, path)
        finally:
            os.unlink(draft)
        folder = os.open(storage_dir, os.O_RDONLY)
        try:
            os.fsync(folder)  # the new name too
        finally:
            os.close(folder)
    return path.read_bytes().strip()


class LinkSigner:
    """Signs and checks download links."""

    def __init__(self, secret: bytes, *, ttl_s: int) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise errors.ConfigError(f"GPUJOBS_LINK_SECRET must be at least {MIN_SECRET_CHARS} characters")
        self._secret = secret
        self.ttl_s = ttl_s

    def _sign(self, job_id: uuid.UUID, name: str, exp: int) -> str:
        message = f"{job_id}\n{name}\n{exp}".encode()
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def url(self, job_id: uuid.UUID, name: str, *, now: float | None = None) -> str:
        """A relative link to one file of a job, valid for the configured time."""
        exp = int((now if now is not None else time.time()) + self.ttl_s)
        return f"/files/{job_id}/{quote(name, safe='')}?exp={exp}&sig={self._sign(job_id, name, exp)}"

    def verify(self, job_id: uuid.UUID, name: str, exp: int, sig: str, *, now: float | None = None) -> None:
        """Forbidden unless the signature matches and the link has not expired."""
        # Compared as bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500).
        if not hmac.compare_digest(self._sign(job_id, name, exp).encode(), sig.encode()):
            raise errors.Forbidden("this download link is not valid")
        if exp < (now if now is not None else time.time()):
            raise errors.LinkExpired("this download link has expired; fetch the job again for a fresh one")
