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


# POST-only addresses of several apps: a reload, a bookmark or an opened link GETs them.
POST_ONLY = [
    ("team-remove", [1], "POST"),  # tenants
    ("tenant-switch", [], "POST"),
    ("logout", [], "POST, OPTIONS"),  # Django's own view
    ("reservation-extend-page", [1], "POST"),  # reservations
    ("cluster-page-teardown", [1], "POST"),  # provisioning
    ("health-node-check", ["gpu-node-1"], "POST"),  # provisioning/health
    ("notifications:webhook-delete", [1], "POST"),  # notifications
]


@pytest.mark.parametrize("name, args, allow", POST_ONLY)
def test_opening_a_post_only_address_answers_a_page_in_the_portal_layout(world, name, args, allow):
    """A GET to an action's address (a reload after "Remove", a bookmarked "Teardown") got Django's bare 405
    with an empty body: a blank page. It now gets a 405 page with the portal's header saying the action needs
    its button, with a way back; the Allow header still names the method the address takes."""
    url = reverse(name, args=args)
    response = _client(world, "alpha-lead").get(url, HTTP_REFERER="http://testserver/team/")
    assert response.status_code == 405, url
    assert response["Allow"] == allow, url
    assert response["Content-Type"].startswith("text/html"), url
    html = response.content.decode()
    assert "<h1>This needs its button</h1>" in html, url
    assert "Nothing was changed" in html and f"<code>{url}</code>" in html, url
    assert 'data-role="lead"' in html and f'href="{reverse("team")}"' in html  # the signed-in header
    assert 'href="/team/">Back to the page you came from' in html and 'href="/">Back to the dashboard' in html


def test_the_405_page_never_links_back_to_another_site_or_to_itself(world):
    url = reverse("team-remove", args=[1])
    client = _client(world, "alpha-lead")
    for referer in ("https://evil.example/phish", f"http://testserver{url}"):
        html = client.get(url, HTTP_REFERER=referer).content.decode()
        assert "Back to the page you came from" not in html and "evil.example" not in html, referer
        assert 'href="/">Back to the dashboard' in html


def test_a_signed_out_get_to_a_post_only_address_gets_the_page_too():
    response = Client().get(reverse("team-remove", args=[1]))
    assert response.status_code == 405 and response["Allow"] == "POST"
    assert "<h1>This needs its button</h1>" in response.content.decode()


def test_api_paths_keep_the_envelope_for_a_wrong_method(world):
    client = _client(world, "alpha-lead")
    response = client.get("/api/v1/reservations/1/cancel/")
    assert response.status_code == 405 and response["Allow"] == "POST, OPTIONS"
    assert response.json() == {"code": "method_not_allowed", "detail": 'Method "GET" not allowed.', "fields": {}}
    response = _client(world, "staff").delete("/api/v1/pools/")
    assert response.status_code == 405 and response.json()["code"] == "method_not_allowed"
