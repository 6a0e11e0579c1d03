"""Dependencies shared by the routes: the process's services and the caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from app import links, registry, storage
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


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking. Until API keys exist every caller is the one local principal."""

    principal: str
    admin: bool

    @property
    def owner_filter(self) -> str | None:
        """Restrict reads to the caller's own jobs, unless an admin asks."""
        return None if self.admin else self.principal


def get_services(request: Request) -> Services:
    """The services built by the app's lifespan."""
    services: Services = request.app.state.services
    return services


def get_caller() -> Caller:
    """The caller of this request."""
    return Caller(principal="anonymous", admin=True)


ServicesDep = Annotated[Services, Depends(get_services)]
CallerDep = Annotated[Caller, Depends(get_caller)]
