"""API keys: made at random, shown once, stored only as a hash, checked on every request.

A key is `gpj_` followed by 43 URL-safe characters: 32 bytes from `secrets`. The database keeps its
SHA-256 and its first 12 characters (to tell keys apart in `gpujobs keys list`), never the key.
SHA-256 without salt or stretching is the right tool here: slow password hashes exist to make
guessing *low-entropy* secrets expensive, and 256 random bits cannot be guessed, so a fast hash
keeps verification at one indexed lookup per request. The row is found by its hash, then the
hashes are compared again with `hmac.compare_digest` so no timing depends on where they differ.

Nothing is cached: each request reads the key's row, so a revoked key fails on its next request.
`last_used_at` is written at most once a minute per key (by the same statement), not per request.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app import db, errors

KEY_PREFIX: Final = "gpj_"
KEY_BYTES: Final = 32
SHOWN_CHARS: Final = 12  # "gpj_" and 8 random characters: enough to tell keys apart, useless to guess
MAX_KEY_CHARS: Final = 128  # longer "keys" are refused before hashing
TOUCH_INTERVAL_S: Final = 60.0
_PRINCIPAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}")
_KEY_CHARS = re.compile(r"[A-Za-z0-9_-]+")


class Role(enum.StrEnum):
    """What a key may do: `user` works on its own jobs, `admin` on everything."""

    user = "user"
    admin = "admin"


class Unauthorized(errors.AppError):
    """Send a valid API key: `Authorization: Bearer <key>` (make one with `gpujobs keys create`)."""

    status_code = 401


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a verified key speaks for."""

    key_id: int
    principal: str
    role: Role

    @property
    def admin(self) -> bool:
        """Whether the key may see and manage every job."""
        return self.role is Role.admin


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A stored key, without its secret."""

    id: int
    principal: str
    prefix: str
    role: Role
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> KeyInfo:
        """Build from an `api_keys` row."""
        return cls(
            row.id,
            row.principal,
            row.prefix,
            Role(row.role),
            row.created_at,
            row.revoked_at,
            row.last_used_at,
        )


@dataclass(frozen=True, slots=True)
class NewKey:
    """A key just made: `secret` is shown to the operator once and never stored."""

    secret: str
    info: KeyInfo


def generate() -> str:
    """A new random key."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def hash_key(secret: str) -> str:
    """The stored form of a key: hex SHA-256 of its text."""
    return hashlib.sha256(secret.encode()).hexdigest()


def check_principal(name: str) -> str:
    """A principal name: 1-64 letters, digits and `_.@+-`, starting with a letter or digit."""
    if not _PRINCIPAL.fullmatch(name):
        raise errors.InvalidRequest(
            f"principal {name!r}: use 1-64 letters, digits or _.@+- (starting with a letter or digit)",
            field="principal",
        )
    return name


def well_formed(secret: str) -> bool:
    """Whether `secret` could be a key at all (checked before any hashing or database work)."""
    return (
        secret.startswith(KEY_PREFIX)
        and len(secret) <= MAX_KEY_CHARS
        and bool(_KEY_CHARS.fullmatch(secret[len(KEY_PREFIX) :]))
    )


_COLUMNS = "id, principal, prefix, role, created_at, revoked_at, last_used_at"

INSERT_KEY = text(
    f"""
    INSERT INTO api_keys (principal, prefix, key_hash, role)
    VALUES (:principal, :prefix, :key_hash, :role)
    RETURNING {_COLUMNS}
    """
)

# Find a key by its hash and, at most once per :touch_s, record that it was used. The UPDATE
# re-reads the row it locks, so concurrent requests write last_used_at once, not once each.
VERIFY_KEY = text(
    """
    WITH found AS (
        SELECT id, principal, role, key_hash, revoked_at FROM api_keys WHERE key_hash = :key_hash
    ), touched AS (
        UPDATE api_keys AS k SET last_used_at = now()
        FROM found
        WHERE k.id = found.id AND k.revoked_at IS NULL
          AND (k.last_used_at IS NULL OR k.last_used_at < now() - make_interval(secs => :touch_s))
        RETURNING k.id
    )
    SELECT id, principal, role, key_hash, revoked_at FROM found
    """
)

REVOKE_KEY = text(
    f"""
    UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())
    WHERE id = :id
    RETURNING {_COLUMNS}
    """
)

FIND_KEYS = text(
    f"""
    SELECT {_COLUMNS} FROM api_keys
    WHERE id = :id OR starts_with(prefix, CAST(:prefix AS text)) OR key_hash = :key_hash
    ORDER BY id
    """
)

KEY_UNREVOKED = text("SELECT EXISTS (SELECT 1 FROM api_keys WHERE id = :id AND revoked_at IS NULL)")

LIST_KEYS = text(f"SELECT {_COLUMNS} FROM api_keys WHERE :all OR revoked_at IS NULL ORDER BY id")

HAS_ADMIN = text("SELECT EXISTS (SELECT 1 FROM api_keys WHERE role = 'admin' AND revoked_at IS NULL)")


class KeyStore:
    """API keys in the database. Each method is one short transaction."""

    def __init__(self, engine: AsyncEngine, *, touch_interval_s: float = TOUCH_INTERVAL_S) -> None:
        self._engine = engine
        self._touch_s = touch_interval_s

    async def create(self, principal: str, *, role: Role = Role.user) -> NewKey:
        """Make and store a key for `principal`; the secret is in the result and nowhere else."""
        secret = generate()
        values = {
            "principal": check_principal(principal),
            "prefix": secret[:SHOWN_CHARS],
            "key_hash": hash_key(secret),
            "role": role.value,
        }
        async with self._engine.begin() as conn:
            row = (await conn.execute(INSERT_KEY, values)).one()
        return NewKey(secret, KeyInfo.from_row(row))

    async def verify(self, secret: str | None) -> Identity:
        """The identity of a valid, unrevoked key; Unauthorized otherwise (same message for all)."""
        if secret is None or not well_formed(secret):
            raise Unauthorized()
        digest = hash_key(secret)
        # One statement on every request: autocommit saves the BEGIN/COMMIT round trips (~40%), and
        # the driver's own fetch SQLAlchemy's result set-up.
        row = await db.fetch_row(self._engine, VERIFY_KEY, {"key_hash": digest, "touch_s": self._touch_s})
        if row is None or not hmac.compare_digest(row["key_hash"], digest) or row["revoked_at"] is not None:
            raise Unauthorized()
        return Identity(row["id"], row["principal"], Role(row["role"]))

    async def unrevoked(self, key_id: int) -> bool:
        """Whether the key with this id still stands: a request that outlives its start (a stream
        held open for hours) asks again, since `verify` answered only at its start."""
        async with self._engine.connect() as conn:
            return bool((await conn.execute(KEY_UNREVOKED, {"id": key_id})).scalar_one())

    async def find(self, key: str) -> KeyInfo:
        """One key by its id, the start of its prefix (as `keys list` shows it) or the whole key."""
        whole = well_formed(key) and len(key) > SHOWN_CHARS
        prefix = key.startswith(KEY_PREFIX) and len(KEY_PREFIX) + 4 <= len(key) <= SHOWN_CHARS
        values = {
            "id": int(key) if key.isascii() and key.isdigit() and len(key) < 19 else None,
            "prefix": key if prefix else None,
            "key_hash": hash_key(key) if whole else None,
        }
        async with self._engine.connect() as conn:
            rows = (await conn.execute(FIND_KEYS, values)).all()
        if not rows:
            raise errors.NotFound(f"no API key {key!r}; see `gpujobs keys list`")
        if len(rows) > 1:
            raise errors.InvalidRequest(
                f"{key!r} matches {len(rows)} keys; give more of the prefix or the id"
            )
        return KeyInfo.from_row(rows[0])

    async def revoke(self, key: str) -> KeyInfo:
        """Revoke a key by id or prefix: it stops working on its next request. Idempotent."""
        found = await self.find(key)
        async with self._engine.begin() as conn:
            row = (await conn.execute(REVOKE_KEY, {"id": found.id})).one()
        return KeyInfo.from_row(row)

    async def list_keys(self, *, include_revoked: bool = False) -> list[KeyInfo]:
        """Every key (by default only those still valid), oldest first."""
        async with self._engine.connect() as conn:
            rows = (await conn.execute(LIST_KEYS, {"all": include_revoked})).all()
        return [KeyInfo.from_row(r) for r in rows]

    async def has_admin(self) -> bool:
        """Whether any unrevoked admin key exists (a new installation has none)."""
        async with self._engine.connect() as conn:
            return bool(await conn.scalar(HAS_ADMIN))
