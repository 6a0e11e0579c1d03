"""Dependencies shared by the routes: the process's services and the caller."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any

import sqlalchemy.exc
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from app import auth, db, errors, learning, links, registry, storage
from app.intake import Limits
from app.queue import manager as manager_


@dataclass(slots=True)
class Services:
    """What one API process holds for its lifetime."""

    manager: manager_.JobManager
    store: storage.ResultStore
    signer: links.LinkSigner
    models: registry.Registry
    limits: Limits
    keys: auth.KeyStore
    learner: learning.VramLearner | None = None
    # Uploads writing to the database now (Settings.upload_writers; None: no limit). FIFO, so under
    # load each upload waits about as long as the others, and PostgreSQL is not asked to interleave
    # dozens of large inserts at once.
    upload_gate: asyncio.Semaphore | None = None


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: the principal of the request's API key, and whether that key is an admin's."""

    principal: str
    admin: bool
    key_id: int | None = None  # its key, checked again where a request outlives its start

    @property
    def owner_filter(self) -> str | None:
        """Restrict reads to the caller's own jobs, unless an admin asks."""
        return None if self.admin else self.principal


# The dependencies are `async def` though they never wait: FastAPI runs a plain `def` dependency in
# its thread pool, a thread hop (and wake-up) per request for a few attribute reads.
async def get_services(request: Request) -> Services:
    """The services built by the app's lifespan."""
    services: Services = request.app.state.services
    return services


# Parses nothing we rely on: the key is verified by `security.Authenticate` before the route runs
# (and before the body is read). Declaring it puts the bearer scheme in the OpenAPI document.
bearer = HTTPBearer(
    auto_error=False,
    scheme_name="apiKey",
    description="An API key from `gpujobs keys create`, sent as `Authorization: Bearer <key>`",
)


async def get_caller(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Caller:
    """The caller, as authenticated by the security middleware; 401 if it was not."""
    caller = caller_of(request)
    if caller is None:
        raise auth.Unauthorized()
    return caller


def caller_of(request: Request) -> Caller | None:
    """The caller the security middleware authenticated, or None (a request it let through bare)."""
    identity = getattr(request.state, "identity", None)
    if not isinstance(identity, auth.Identity):
        return None
    return Caller(principal=identity.principal, admin=identity.admin, key_id=identity.key_id)


async def require_admin(caller: Annotated[Caller, Depends(get_caller)]) -> Caller:
    """The caller, if it holds an admin key; 403 otherwise."""
    if not caller.admin:
        raise errors.Forbidden("this needs an admin key")
    return caller


def unavailable(exc: BaseException) -> errors.Unavailable | None:
    """The 503 for a database error that means "not now": the database is down, short of disk
    space, memory or connections, or so slow that no pooled connection came free within the pool's
    timeout. None for any other error."""
    if isinstance(exc, sqlalchemy.exc.TimeoutError):  # the pool's wait, not a statement's
        return errors.Unavailable("the database is busy: no connection came free in time; try again shortly")
    match db.shortage(exc):
        case db.DISK_FULL:
            return errors.Unavailable(
                "the database is out of disk space: nothing was written; its operator must free space "
                "on PostgreSQL's disk (its data folder); try again once it has room",
                retry_after_s=30,
            )
        case db.OUT_OF_MEMORY:
            return errors.Unavailable("the database is out of memory; try again shortly", retry_after_s=10)
    return errors.Unavailable() if db.is_unavailable(exc) else None


class InvalidPublic(BaseModel):
    """A 422: our message naming the field, or FastAPI's list of field errors (each with its `loc`)."""

    detail: str | list[dict[str, Any]]


ServicesDep = Annotated[Services, Depends(get_services)]
CallerDep = Annotated[Caller, Depends(get_caller)]
AdminDep = Annotated[Caller, Depends(require_admin)]
