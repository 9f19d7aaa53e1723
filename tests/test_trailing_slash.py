"""A request to an API path without its trailing slash is redirected with a 308, which keeps its method and
body: a client that follows it makes the booking it meant to, instead of a GET of the list (Django's 301)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from reservations.models import Reservation

from .conftest import iso

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("debug", [False, True])
def test_a_post_without_the_trailing_slash_is_redirected_keeping_the_request(world, t0, settings, debug):
    settings.DEBUG = debug  # DEBUG (make run) used to answer Django's RuntimeError page instead
    client = world.client("alpha-lead")
    body = {"pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=1))}
    response = client.post("/api/v1/reservations?x=1", body, format="json")
    assert response.status_code == 308
    assert response["Location"] == "/api/v1/reservations/?x=1"
    assert Reservation.objects.count() == 0
    followed = client.post("/api/v1/reservations", body, format="json", follow=True)
    assert followed.status_code == 201, followed.content
    assert followed.redirect_chain == [("/api/v1/reservations/", 308)]
    assert Reservation.objects.count() == 1


def test_a_patch_without_the_trailing_slash_changes_the_booking(world, t0):
    client = world.client("alpha-lead")
    created = client.post("/api/v1/reservations/", {"pool": "h100", "node_count": 1, "start": iso(t0),
                                                    "end": iso(t0 + timedelta(hours=1))}, format="json").json()
    followed = client.patch(f"/api/v1/reservations/{created['id']}", {"name": "renamed"}, format="json",
                            follow=True)
    assert followed.status_code == 200 and followed.json()["name"] == "renamed"
    assert Reservation.objects.get(pk=created["id"]).name == "renamed"


def test_pages_are_redirected_too(world):
    from django.test import Client

    client = Client()
    client.force_login(world.users["alpha-lead"])
    response = client.get("/reservations")
    assert response.status_code == 308 and response["Location"] == "/reservations/"
