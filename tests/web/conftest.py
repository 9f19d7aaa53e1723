"""Fixtures for the server-rendered pages: Django's test client signed in as a world user."""

from __future__ import annotations

from datetime import timedelta

import pytest

from reservations import services
from tenants.choices import Role
from tenants.models import Membership


@pytest.fixture
def book(world):
    """Book through the real service: book("alpha-lead", t0, hours=2, nodes=1)."""

    def _book(who: str, start, *, hours: int = 2, nodes: int = 1, name: str = "", tenant: str | None = None):
        user = world.users[who]
        slug = tenant or who.split("-")[0]
        return services.reservation_create(
            actor=user, tenant=world.tenants[slug], pool=world.pool, node_count=nodes, start=start,
            end=start + timedelta(hours=hours), name=name or f"{who}-run",
        )

    return _book


@pytest.fixture
def multi_tenant_user(world):
    """alpha-lead also becomes a viewer of beta: a user with two tenants and two roles."""
    Membership.objects.create(user=world.users["alpha-lead"], tenant=world.tenants["beta"], role=Role.VIEWER)
    return world.users["alpha-lead"]
