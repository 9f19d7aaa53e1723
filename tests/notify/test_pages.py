"""The lead's notification pages and the audit page: leads of their own tenant only, secrets masked."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from notifications import services
from notifications.choices import DeliveryStatus
from notifications.models import Channel, Delivery, url_fingerprint
from notifications.slack import Event
from portal.core.models import AuditLog
from tenants.models import Tenant
from tenants.services import quota_update

pytestmark = pytest.mark.django_db

SLACK_URL = "https://hooks.slack.com/services/T000/B000/lead-secret-abcdef"


@pytest.fixture
def as_user(world):
    def _client(who: str) -> Client:
        client = Client()
        client.force_login(world.users[who])
        return client

    return _client


@pytest.mark.parametrize("who", ["alpha-member", "alpha-viewer"])
def test_only_leads_manage_notifications(as_user, who):
    client = as_user(who)
    assert client.get(reverse("notifications:settings")).status_code == 403
    assert client.get(reverse("notifications:deliveries")).status_code == 403
    assert client.post(reverse("notifications:slack-url"), {"url": SLACK_URL}).status_code == 403
    assert Client().get(reverse("notifications:settings")).status_code == 302  # to the sign-in page


def test_lead_sets_the_slack_url_and_never_sees_it_again(world, as_user):
    lead = as_user("alpha-lead")
    assert lead.get(reverse("notifications:settings")).status_code == 200
    response = lead.post(reverse("notifications:slack-url"), {"url": SLACK_URL})
    assert response.status_code == 302
    assert Tenant.objects.get(slug="alpha").slack_webhook_url == SLACK_URL
    html = lead.get(reverse("notifications:settings")).content.decode()
    assert SLACK_URL not in html and "lead-secret" not in html and "abcdef" in html  # masked tail only
    (audit,) = AuditLog.objects.filter(action="tenant.slack_webhook")
    assert audit.actor == world.users["alpha-lead"] and "lead-secret" not in str(audit.after)


def test_lead_chooses_events_and_sends_a_test(world, as_user):
    lead = as_user("alpha-lead")
    lead.post(reverse("notifications:slack-url"), {"url": SLACK_URL})
    response = lead.post(reverse("notifications:slack-events"),
                         {"events": [Event.RESERVATION_CONFIRMED, Event.CLUSTER_READY], "enabled": "on"})
    assert response.status_code == 302
    channel = Channel.objects.get(tenant=world.tenants["alpha"], kind="slack")
    assert channel.events == [Event.RESERVATION_CONFIRMED, Event.CLUSTER_READY] and channel.enabled
    lead.post(reverse("notifications:slack-test"))
    (test,) = Delivery.objects.filter(event=Event.TEST)
    assert test.channel == channel and test.status == DeliveryStatus.PENDING
    assert AuditLog.objects.filter(action="notifications.test", actor=world.users["alpha-lead"]).exists()


def test_webhook_secret_is_shown_once_then_masked(world, as_user):
    lead = as_user("alpha-lead")
    created = lead.post(reverse("notifications:webhook-create"),
                        {"name": "ci", "url": "https://ci.alpha.example/hook", "events": [Event.CLUSTER_READY]})
    assert created.status_code == 200
    channel = Channel.objects.get(tenant=world.tenants["alpha"], kind="webhook")
    assert channel.secret.startswith("whsec_") and channel.secret in created.content.decode()
    assert "no-store" in created["Cache-Control"]  # no browser or proxy cache keeps the secret
    again = lead.get(reverse("notifications:settings")).content.decode()
    assert channel.secret not in again and "ci.alpha.example/hook" not in again

    rotated = lead.post(reverse("notifications:webhook-rotate", args=[channel.pk]), {"confirm": "yes"})
    channel.refresh_from_db()
    assert channel.secret in rotated.content.decode() and channel.previous_secret_expires_at is not None
    assert "no-store" in rotated["Cache-Control"]

    lead.post(reverse("notifications:webhook-edit", args=[channel.pk]),
              {f"w{channel.pk}-name": "ci-2", f"w{channel.pk}-events": [Event.CLUSTER_FAILED]})
    channel.refresh_from_db()
    assert channel.name == "ci-2" and channel.events == [Event.CLUSTER_FAILED] and not channel.enabled
    lead.post(reverse("notifications:webhook-delete", args=[channel.pk]))
    assert not Channel.objects.filter(pk=channel.pk).exists()


def test_bad_webhook_url_is_refused(as_user):
    response = as_user("alpha-lead").post(reverse("notifications:webhook-create"), {"url": "ftp://x"})
    assert response.status_code == 400 and not Channel.objects.exists()


def test_another_tenants_channels_and_deliveries_are_404(world, as_user, webhook_for, t0, book):
    channel, _ = webhook_for("beta", "https://ci.beta.example/hook")
    reservation = book("beta", t0)
    (delivery,) = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    lead = as_user("alpha-lead")
    for name in ("webhook-rotate", "webhook-delete", "channel-test", "channel-clear"):
        assert lead.post(reverse(f"notifications:{name}", args=[channel.pk])).status_code == 404
    assert lead.post(reverse("notifications:delivery-retry", args=[delivery.pk])).status_code == 404
    log = lead.get(reverse("notifications:deliveries")).content.decode()
    assert f'data-delivery="{delivery.pk}"' not in log and "beta" not in log.lower().replace("alpha", "")


def test_delivery_log_shows_status_and_slack_errors(world, as_user, slack_for, t0, book):
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0, name="nightly")
    (delivery,) = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    Delivery.objects.filter(pk=delivery.pk).update(status=DeliveryStatus.FAILED, last_status_code=404,
                                                   last_error="channel_not_found", attempts=1)
    lead = as_user("alpha-lead")
    html = lead.get(reverse("notifications:deliveries") + "?status=failed").content.decode()
    assert f'data-delivery="{delivery.pk}"' in html and "channel_not_found" in html and "nightly" in html
    staff = as_user("staff")
    assert "channel_not_found" in staff.get(reverse("notifications:deliveries")).content.decode()
    lead.post(reverse("notifications:delivery-retry", args=[delivery.pk]))
    assert Delivery.objects.get(pk=delivery.pk).status == DeliveryStatus.PENDING


def test_a_delivery_whose_channel_was_deleted_is_not_offered_or_taken_for_a_retry(world, as_user, webhook_for, t0,
                                                                                    book):
    # Its row stays in the log (SET_NULL), and "Retry" was offered and answered "Delivery #n queued again."
    # although there is nowhere to send it: the worker skipped it at once ("channel_deleted"), again.
    channel, _ = webhook_for("alpha", "https://ci.alpha.example/hook")
    reservation = book("alpha", t0)
    (delivery,) = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    Delivery.objects.filter(pk=delivery.pk).update(status=DeliveryStatus.FAILED, last_error="http_500", attempts=1)
    lead = as_user("alpha-lead")
    services.channel_delete(actor=world.users["alpha-lead"], channel=channel)

    log = lead.get(reverse("notifications:deliveries")).content.decode()
    row = re.search(rf'<tr data-delivery="{delivery.pk}".*?</tr>', log, re.S).group(0)
    assert "Retry" not in row and "Webhook ci (alpha)" in row
    response = lead.post(reverse("notifications:delivery-retry", args=[delivery.pk]), follow=True)
    assert [str(m) for m in response.context["messages"]] == [
        "The channel of this delivery has been deleted; there is nowhere to send it."]
    assert Delivery.objects.values_list("status", "attempts").get(pk=delivery.pk) == (DeliveryStatus.FAILED, 1)
    assert not AuditLog.objects.filter(action="notifications.delivery.requeue").exists()


def test_dashboard_tag_tells_the_lead_what_broke(world, as_user, slack_for):
    channel = slack_for("alpha", SLACK_URL)
    Channel.objects.filter(pk=channel.pk).update(
        broken_at="2026-01-01T00:00:00Z", broken_error="channel_is_archived", broken_status=410,
        broken_url_fp=url_fingerprint(SLACK_URL))
    html = as_user("alpha-lead").get(reverse("notifications:settings")).content.decode()
    assert "Notifications need attention" in html and "channel_is_archived" in html
    assert "Notifications need attention" not in as_user("beta-lead").get(
        reverse("notifications:settings")).content.decode()


def test_leads_read_their_tenants_audit_log_only(world, as_user):
    quota_update(actor=world.users["staff"], quota=world.tenants["alpha"].quotas.get(), max_nodes=5)
    quota_update(actor=world.users["staff"], quota=world.tenants["beta"].quotas.get(), max_nodes=6)
    html = as_user("alpha-lead").get(reverse("audit-log")).content.decode()
    assert re.search(r"Max nodes: 3 → 5", html) and "3 → 6" not in html
    assert "staff" in html
    assert as_user("alpha-member").get(reverse("audit-log")).status_code == 403
    assert Client().get(reverse("audit-log")).status_code == 302
    staff_html = as_user("staff").get(reverse("audit-log")).content.decode()
    assert "3 → 5" in staff_html and "3 → 6" in staff_html


@pytest.mark.parametrize("url, why", [("http://10.0.0.5/hook", "public addresses"), ("ftp://x", "valid URL")])
def test_a_refused_webhook_edit_keeps_what_was_typed_and_says_why_beside_it(world, as_user, settings, url, why):
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    channel, _ = services.webhook_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                         url="https://93.184.216.34/hook", name="ci", events=[Event.CLUSTER_READY])
    before = Channel.objects.values("name", "url", "events", "enabled").get(pk=channel.pk)
    response = as_user("alpha-lead").post(
        reverse("notifications:webhook-edit", args=[channel.pk]),
        {f"w{channel.pk}-name": "ci-renamed", f"w{channel.pk}-url": url, f"w{channel.pk}-enabled": "on",
         f"w{channel.pk}-events": [Event.CLUSTER_FAILED]})
    assert response.status_code == 400
    html = response.content.decode()
    block = html[html.index(f'data-channel="{channel.pk}"'):]
    block = block[:block.index("</details>")]
    assert re.search(r'<details class="webhook" data-channel="\d+" open', html)  # not folded away
    assert 'value="ci-renamed"' in block and f'value="{url}"' in block
    assert re.search(rf'value="{Event.CLUSTER_FAILED}"[^>]*checked', block)
    assert not re.search(rf'value="{Event.CLUSTER_READY}"[^>]*checked', block)
    assert why in block  # the reason sits beside the field, not only in a banner above the page
    assert Channel.objects.values("name", "url", "events", "enabled").get(pk=channel.pk) == before


def test_a_refused_slack_url_is_explained_beside_the_field_with_what_was_typed(world, as_user, settings):
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    lead = as_user("alpha-lead")
    response = lead.post(reverse("notifications:slack-url"), {"url": "https://10.0.0.5/services/T/B/x"})
    assert response.status_code == 400  # the page again, not a redirect to an empty form
    html = response.content.decode()
    form = html[html.index('action="/notifications/slack/url/"'):]
    form = form[:form.index("</form>")]
    assert 'value="https://10.0.0.5/services/T/B/x"' in form and "public addresses" in form
    assert "slack_webhook_url" not in html  # the model's field name means nothing to a lead
    assert Tenant.objects.get(slug="alpha").slack_webhook_url == ""


def test_a_slack_url_that_is_not_a_url_gets_one_reason_not_two(as_user):
    response = as_user("alpha-lead").post(reverse("notifications:slack-url"), {"url": "not a url"})
    assert response.status_code == 400
    html = response.content.decode()
    assert "Enter a valid URL." in html
    assert "Paste the new URL" not in html  # they did paste one; it is just not a URL


def test_resume_sending_on_a_channel_that_is_not_broken_says_so_and_records_nothing(world, as_user, slack_for):
    # A second click, or a page left open while a delivered message repaired the channel: the answer was
    # "The channel sends again." and a "repaired" audit row by the lead although nothing was broken.
    channel = slack_for("alpha", SLACK_URL)
    lead = as_user("alpha-lead")
    response = lead.post(reverse("notifications:channel-clear", args=[channel.pk]), follow=True)
    shown = [str(m) for m in response.context["messages"]]
    assert shown == ["The channel was not broken; nothing to clear."], shown
    assert not AuditLog.objects.filter(action="notifications.channel.repaired").exists()
    Channel.objects.filter(pk=channel.pk).update(
        broken_at="2026-01-01T00:00:00Z", broken_error="channel_is_archived", broken_status=410,
        broken_url_fp=url_fingerprint(SLACK_URL))
    response = lead.post(reverse("notifications:channel-clear", args=[channel.pk]), follow=True)
    assert [str(m) for m in response.context["messages"]] == ["The channel sends again."]
    assert not Channel.objects.get(pk=channel.pk).is_broken
    assert AuditLog.objects.filter(action="notifications.channel.repaired").count() == 1


def test_webhook_urls_posted_to_the_pages_are_hidden_from_error_reports(world, as_user, webhook_for):
    """A Slack or webhook URL is a bearer secret: if saving it ever fails with a 500, Django's error report
    (logged, mailed to ADMINS) must show the POST with the URL starred out, as it does for passwords."""
    from django.views.debug import SafeExceptionReporterFilter

    lead = as_user("alpha-lead")
    channel, _ = webhook_for("alpha", "https://ci.example.com/hooks/one")
    posts = [
        (reverse("notifications:slack-url"), {"url": SLACK_URL}, "url"),
        (reverse("notifications:webhook-create"), {"url": "https://ci.example.com/hooks/secret-path"}, "url"),
        (reverse("notifications:webhook-edit", args=[channel.pk]),
         {f"w{channel.pk}-url": "https://ci.example.com/hooks/other-secret", f"w{channel.pk}-enabled": "on"},
         f"w{channel.pk}-url"),
    ]
    for path, data, field in posts:
        response = lead.post(path, data)
        assert response.status_code in (200, 302), (path, response.status_code)
        shown = SafeExceptionReporterFilter().get_post_parameters(response.wsgi_request)
        assert shown[field] != data[field] and "secret" not in shown[field], path


def test_every_time_on_the_notification_pages_names_its_zone(world, as_user, slack_for, webhook_for, t0, book):
    """The delivery log said "next 19:00:05" for a retry, and its When column, the broken-channel alert and the
    old secret's end after a rotation gave "Thu 3 Dec 19:00": none said which zone the time was in."""
    from datetime import timedelta
    from zoneinfo import ZoneInfo

    from django.utils import timezone

    from tests.zoned import unzoned_times

    tokyo = ZoneInfo("Asia/Tokyo")
    channel = slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0, name="nightly")
    (delivery,) = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    next_at = timezone.now() + timedelta(minutes=5)
    Delivery.objects.filter(pk=delivery.pk).update(status=DeliveryStatus.RETRYING, next_attempt_at=next_at,
                                                   attempts=1)
    broken_at = timezone.now() - timedelta(hours=1)
    Channel.objects.filter(pk=channel.pk).update(broken_at=broken_at, broken_error="channel_is_archived",
                                                 broken_status=410, broken_url_fp=url_fingerprint(SLACK_URL))
    hook, _ = webhook_for("alpha", "https://ci.alpha.example/hook")
    lead = as_user("alpha-lead")
    session = lead.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()

    log = lead.get(reverse("notifications:deliveries")).content.decode()
    # With its day: a retry backs off for hours, past midnight, and its row's date is the message's, not the retry's.
    assert f"next {next_at.astimezone(tokyo):%a %-d %b %H:%M:%S} JST" in log, log
    assert f"{Delivery.objects.get(pk=delivery.pk).created_at.astimezone(tokyo):%H:%M} JST" in log
    assert not unzoned_times(log), unzoned_times(log)
    # The event's text ("Reservation confirmed: nightly (alpha), 1 × …, 2026-12-09T09:00:00Z → …") in the
    # reader's zone and the site's format, as the page's footer says its times are.
    assert f"{reservation.start.astimezone(tokyo):%a %-d %b %H:%M} JST → " in log, log
    text = re.sub(r"<[^>]*>", " ", log)
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", text), re.findall(r".{0,60}\d{4}-\d\d-\d\dT.{0,20}", text)
    page = lead.get(reverse("notifications:settings")).content.decode()
    assert f"{broken_at.astimezone(tokyo):%H:%M} JST" in page and "channel_is_archived" in page
    assert not unzoned_times(page), unzoned_times(page)
    asked = lead.get(reverse("notifications:webhook-rotate", args=[hook.pk])).content.decode()
    assert not unzoned_times(asked), unzoned_times(asked)
    rotated = lead.post(reverse("notifications:webhook-rotate", args=[hook.pk]),
                        {"confirm": "yes", "version": services.secret_version(hook)}).content.decode()
    hook.refresh_from_db()
    assert f"Until {hook.previous_secret_expires_at.astimezone(tokyo):%a %-d %b %H:%M} JST requests" in rotated
    assert not unzoned_times(rotated), unzoned_times(rotated)
