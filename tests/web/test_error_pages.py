"""Pages for every role: the error pages (403, 404) keep the signed-in header, empty states fit the reader."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

pytestmark = pytest.mark.django_db


def _client(world, who: str) -> Client:
    client = Client()
    client.force_login(world.users[who])
    return client


def test_a_forbidden_page_still_says_who_you_are_and_what_you_can_reach(world):
    response = _client(world, "alpha-viewer").get(reverse("booking-form"))
    assert response.status_code == 403
    html = response.content.decode()
    assert "Your role does not allow booking" in html
    assert 'data-role="viewer"' in html  # why: the role the refusal is about
    assert "Team Alpha" in html and f'href="{reverse("team")}"' in html
    assert f'href="{reverse("reservation-list-page")}"' in html


def test_a_missing_reservation_page_keeps_the_leads_menu(world):
    response = _client(world, "alpha-lead").get(reverse("reservation-page", args=[987654]))
    assert response.status_code == 404
    html = response.content.decode()
    assert 'data-role="lead"' in html and f'href="{reverse("team")}"' in html
    assert f'href="{reverse("usage")}"' in html


@pytest.mark.parametrize("who, says", [
    ("alpha-member", "book nodes and a cluster appears here"),
    ("alpha-viewer", "when your team books nodes"),
    (None, "not a member of any tenant yet"),
])
def test_the_empty_cluster_list_says_what_this_user_can_do(world, who, says):
    from django.contrib.auth import get_user_model

    if who is None:
        world.users["loner"] = get_user_model().objects.create_user(username="loner", password="pw-Long-enough-1")
        who = "loner"
    html = _client(world, who).get(reverse("cluster-list-page")).content.decode()
    assert says in html
    if who != "alpha-member":
        assert "book nodes and" not in html  # neither can book
