"""Rotating a webhook's signing secret asks first, on a page of its own (no JavaScript needed), as cancelling a
reservation does: one click on "Rotate secret" replaced the secret at once, and the receiver's old secret
started expiring (or, with PORTAL_NOTIFY_SECRET_OVERLAP_HOURS=0, stopped verifying) without a word."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from notifications import services
from notifications.models import Channel
from portal.core.models import AuditLog

pytestmark = pytest.mark.django_db

URL = "https://ci.alpha.example/hook"


@pytest.fixture
def lead(world):
    client = Client()
    client.force_login(world.users["alpha-lead"])
    return client


@pytest.fixture
def webhook(world):
    channel, secret = services.webhook_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                              url=URL, name="ci")
    return channel, secret


def _unchanged(channel: Channel, secret: str) -> bool:
    stored = Channel.objects.get(pk=channel.pk)
    return (stored.secret == secret and not stored.previous_secret
            and not AuditLog.objects.filter(action="notifications.webhook.rotate").exists())


def test_the_settings_page_links_to_a_confirmation_instead_of_rotating_in_one_click(lead, webhook):
    channel, _ = webhook
    rotate = reverse("notifications:webhook-rotate", args=[channel.pk])
    html = lead.get(reverse("notifications:settings")).content.decode()
    assert f'href="{rotate}"' in html  # a link to the question, not a form that rotates
    assert f'action="{rotate}"' not in html


def test_the_confirmation_page_says_what_happens_and_changes_nothing(lead, webhook, settings):
    settings.PORTAL_NOTIFY_SECRET_OVERLAP_HOURS = 24
    channel, secret = webhook
    rotate = reverse("notifications:webhook-rotate", args=[channel.pk])
    page = lead.get(rotate)
    assert page.status_code == 200
    html = page.content.decode()
    assert "ci" in html and "24 hours" in html
    assert f'action="{rotate}"' in html and 'name="confirm"' in html
    assert reverse("notifications:settings") in html  # the way back, rotating nothing
    assert _unchanged(channel, secret)

    settings.PORTAL_NOTIFY_SECRET_OVERLAP_HOURS = 0
    assert "at once" in lead.get(rotate).content.decode()


def test_a_post_without_the_confirmation_rotates_nothing(lead, webhook):
    """A settings page still open from before (its one-click form) asks instead of rotating."""
    channel, secret = webhook
    response = lead.post(reverse("notifications:webhook-rotate", args=[channel.pk]))
    assert response.status_code == 200 and 'name="confirm"' in response.content.decode()
    assert secret not in response.content.decode()
    assert _unchanged(channel, secret)


def test_confirming_rotates_and_shows_the_new_secret_once(lead, webhook):
    channel, secret = webhook
    response = lead.post(reverse("notifications:webhook-rotate", args=[channel.pk]), {"confirm": "yes"})
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    stored = Channel.objects.get(pk=channel.pk)
    assert stored.secret != secret and stored.previous_secret == secret
    assert stored.secret in response.content.decode()
    assert AuditLog.objects.filter(action="notifications.webhook.rotate").count() == 1


@pytest.mark.parametrize("who", ["alpha-member", "beta-lead"])
def test_others_get_no_confirmation_page(world, webhook, who):
    channel, secret = webhook
    client = Client()
    client.force_login(world.users[who])
    rotate = reverse("notifications:webhook-rotate", args=[channel.pk])
    assert client.get(rotate).status_code in (403, 404)
    assert client.post(rotate, {"confirm": "yes"}).status_code in (403, 404)
    assert _unchanged(channel, secret)


def _confirmation(page) -> dict:
    """The confirmation form's fields, as the browser posts them (the button's name and value included)."""
    import re

    html = page.content.decode()
    form = html[html.index('<form method="post" action="/notifications/webhooks/'):]
    form = form[:form.index("</form>")]
    fields = dict(re.findall(r'<input type="hidden" name="(?!csrfmiddlewaretoken)([^"]+)" value="([^"]*)"', form))
    fields.update(re.findall(r'<button type="submit" name="([^"]+)" value="([^"]*)"', form))
    return fields


def test_a_double_submitted_confirmation_rotates_once_and_keeps_the_old_secret_signing(lead, webhook):
    """Two posts of one confirmation (a double click, a resubmitted form) rotated twice: the second made the
    first's new secret the "previous" one, and the receiver's old secret stopped verifying at once, overlap or
    not. The confirmation names the secret it replaces; the second post is refused and changes nothing."""
    channel, secret = webhook
    rotate = reverse("notifications:webhook-rotate", args=[channel.pk])
    fields = _confirmation(lead.get(rotate))
    assert fields.get("confirm") == "yes" and secret not in str(fields)
    first = lead.post(rotate, fields)
    assert first.status_code == 200
    after_first = Channel.objects.get(pk=channel.pk)
    assert after_first.previous_secret == secret
    second = lead.post(rotate, fields, follow=True)
    stored = Channel.objects.get(pk=channel.pk)
    assert (stored.secret, stored.previous_secret) == (after_first.secret, secret)
    assert "rotated since you opened" in second.content.decode()
    assert AuditLog.objects.filter(action="notifications.webhook.rotate").count() == 1


def test_the_confirmation_warns_when_a_previous_secret_still_signs(lead, webhook, world):
    channel, _ = webhook
    services.webhook_rotate_secret(actor=world.users["alpha-lead"], channel=channel)
    html = lead.get(reverse("notifications:webhook-rotate", args=[channel.pk])).content.decode()
    assert "stops signing at once" in html
    # The time says its zone, as every other time on these pages does ("D j M H:i T").
    assert re.search(r"still signs until \w{3} \d{1,2} \w{3} \d\d:\d\d [A-Z][A-Za-z0-9+-]*:", html), html




def test_the_admin_channel_list_shows_a_broken_channel_and_since_when_in_utc(world, webhook):
    """The channel list's status column formatted the time after format_html had made it a string: the whole list
    answered 500 as soon as one channel was broken. It now shows "(since … UTC)", in UTC whatever the offset."""
    from datetime import datetime, timedelta, timezone

    from notifications.models import url_fingerprint

    channel, _ = webhook
    Channel.objects.filter(pk=channel.pk).update(
        broken_at=datetime(2026, 3, 1, 9, 30, tzinfo=timezone(timedelta(hours=2))), broken_error="http_404",
        broken_url_fp=url_fingerprint(URL))
    assert Channel.objects.get(pk=channel.pk).is_broken
    staff = Client()
    staff.force_login(world.users["staff"])
    response = staff.get(reverse("admin:notifications_channel_changelist"))
    assert response.status_code == 200
    html = response.content.decode()
    assert "broken: http_404" in html and "(since 2026-03-01 07:30 UTC)" in html
