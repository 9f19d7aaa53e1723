"""The portal's own error pages (403, 404) keep the signed-in header: tenant, role and every link."""

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
