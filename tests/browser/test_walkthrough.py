"""Defects found walking the portal's everyday tasks as a lead, a member and platform staff."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from .conftest import PHONE

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

_DUPLICATE_IDS = """() => { const seen = {};
  document.querySelectorAll('[id]').forEach(e => { seen[e.id] = (seen[e.id] || 0) + 1; });
  return Object.keys(seen).filter(id => seen[id] > 1); }"""


def test_the_notifications_pages_slack_and_webhook_fields_each_have_their_own_label(world, live_server, new_page,
                                                                                   sign_in):
    """The Slack form and the "Add a webhook" form both rendered their fields as id_url and id_events_N: the
    "Endpoint URL" label named (and its click focused) the Slack field, the webhook's URL field had no name at
    all, and once Slack was set up, clicking an event's name under "Add a webhook" ticked Slack's box instead."""
    from tenants.models import Tenant

    Tenant.objects.filter(pk=world.tenants["alpha"].pk).update(
        slack_webhook_url="https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXX")
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/notifications/")
    assert page.evaluate(_DUPLICATE_IDS) == []

    webhooks = page.locator("form[action$='/notifications/webhooks/']")
    slack_events = page.locator("form[action$='/notifications/slack/events/']")
    page.get_by_label("Endpoint URL").fill("https://ci.example.com/hooks/gpu-portal")
    expect(webhooks.locator("input[name=url]")).to_have_value("https://ci.example.com/hooks/gpu-portal")
    expect(page.locator("form[action$='/notifications/slack/url/'] input[name=url]")).to_have_value("")

    slack_box = slack_events.get_by_role("checkbox", name="Cluster ready")
    webhook_box = webhooks.get_by_role("checkbox", name="Cluster ready")
    expect(slack_box).to_be_checked()
    expect(webhook_box).to_be_checked()
    webhooks.get_by_text("Cluster ready").click()
    expect(webhook_box).not_to_be_checked()
    expect(slack_box).to_be_checked()


def test_the_api_token_list_fits_a_phone(world, live_server, new_page, sign_in):
    """On a phone the account page's token table (name, token, created, last used, expires, revoke) made the
    whole page scroll sideways (about 120px) with the Revoke button off the screen, and a long name without a
    break (a CI job's) stretched the page further still, on a desktop too. Then the table scrolled in its own
    box and the Revoke button still sat 160-200px out of sight there; now each token is a block of lines on a
    phone and its button is on screen without any sideways scrolling."""
    from tenants.services import token_issue_own

    user = world.users["alpha-member"]
    token_issue_own(user=user, name="laptop", expires_in_days=90)
    token_issue_own(user=user, name="ci-" + "x" * 90, expires_in_days=90)
    for viewport in (PHONE, None):
        page = sign_in(new_page(viewport=viewport), "alpha-member")
        page.goto(f"{live_server.url}/account/")
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the account page scrolls sideways by {overflow}px"
        region = page.locator("#api-tokens")
        revoke = region.get_by_role("button", name="Revoke").first
        revoke.scroll_into_view_if_needed()
        expect(revoke).to_be_in_viewport(ratio=1)
        # On the screen where the page put it, not reached by scrolling the table sideways in its own box.
        wrap = region.locator(".table-wrap")
        assert wrap.evaluate("el => el.scrollLeft") == 0
        hidden = wrap.evaluate("el => el.scrollWidth - el.clientWidth")
        assert hidden <= 1, f"{hidden}px of the token table is scrolled out of sight"
        box, width = revoke.bounding_box(), page.evaluate("document.documentElement.clientWidth")
        assert box["x"] >= 0 and box["x"] + box["width"] <= width, (box, width)


def test_a_nodes_health_page_fits_a_phone(world, live_server, new_page, sign_in):
    """Staff on call open a node's health page from a phone to drain it: the check-level select (its longest
    option) and the checks table pushed the page 120px wide, the Drain form's Reason field half off screen."""
    page = sign_in(new_page(viewport=PHONE), "staff")
    page.goto(f"{live_server.url}/health/nodes/h100-001/")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the node's health page scrolls sideways by {overflow}px"
    for control in (page.get_by_label("Level"), page.get_by_label("Reason"),
                    page.get_by_role("button", name="Drain and open a repair")):
        box = control.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], box

    page.get_by_label("Reason").fill("customer reports NCCL hangs")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Drain and open a repair").click()
    expect(page.get_by_text("h100-001 is drained")).to_be_visible()
    for path in ("/health/", "/health/nodes/h100-001/"):  # the open repair is listed on both
        page.goto(live_server.url + path)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{path} scrolls sideways by {overflow}px"


def test_a_refused_new_end_says_why_without_the_apis_field_name(world, live_server, new_page, sign_in, day):
    """A new end before the start, or off the pool's grid, came back beside the field as "Not changed: end:
    Must be after start." - the API's field code in the middle of the sentence."""
    import re

    from reservations import services

    from .conftest import at

    mine = services.reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    page = sign_in(new_page(viewport=PHONE), "alpha-member")
    page.goto(f"{live_server.url}/reservations/{mine.pk}/")
    for typed, why in ((f"{day.isoformat()}T09:00", "Must be after start."),
                       (f"{day.isoformat()}T13:30", "grid")):
        field = page.get_by_label(re.compile("^New end"))
        field.fill(typed)
        page.get_by_role("button", name="Change end").click()
        field = page.get_by_label(re.compile("^New end"))
        expect(field).to_have_value(typed)
        reason = page.locator(f"#{field.get_attribute('aria-describedby')}")
        expect(reason).to_contain_text(why)
        assert reason.inner_text().startswith("Not changed: "), reason.inner_text()
        assert "end:" not in reason.inner_text(), reason.inner_text()
    mine.refresh_from_db()
    assert mine.end == at(day, 12)


def test_lowering_a_quota_says_no_limit_rather_than_none_h(world, live_server, new_page, sign_in, day):
    """Staff lowering a quota below what is booked were asked to confirm "max duration none h → none h", and
    the bulk change listed the quotas as "max — h": a quota without a longest booking read as a duration."""
    from reservations import services
    from tenants.models import Quota

    from .conftest import at

    services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=3, start=at(day, 10), end=at(day, 12), name="big-run")
    quota = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    assert quota.max_duration_hours is None
    page = sign_in(new_page(), "staff")
    page.goto(f"{live_server.url}/admin/tenants/quota/{quota.pk}/change/")
    page.get_by_label("Max nodes").fill("1")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.get_by_role("heading", name="Lower a quota below what is booked?")).to_be_visible()
    summary = page.locator(".quota-lowering h2 + p")
    expect(summary).to_contain_text("max nodes 3 → 1")
    expect(summary).to_contain_text("max duration no limit → no limit")
    assert "none" not in summary.inner_text(), summary.inner_text()

    page.goto(f"{live_server.url}/admin/tenants/quota/")
    page.locator(f"input[name=_selected_action][value='{quota.pk}']").check()
    page.locator("select[name=action]").select_option("bulk_change")
    page.get_by_role("button", name="Go").click()
    listed = page.locator("#content li", has_text="alpha / h100")
    expect(listed).to_contain_text("longest booking no limit")
    assert "—" not in listed.inner_text(), listed.inner_text()


def test_deleting_a_webhook_and_reissuing_the_calendar_feed_ask_first(world, live_server, new_page, sign_in):
    """A lead's one click on a webhook's "Delete" threw away its endpoint and signing secret, and "Issue new
    addresses to every member" broke every member's calendar subscription, with no question asked, while
    revoking a token, removing a member and tearing a cluster down all ask. Dismissing the question now
    changes nothing; accepting it does what the button says."""
    from notifications.models import Channel
    from tenants.models import Tenant

    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/notifications/")
    page.get_by_label("Endpoint URL").fill("https://ci.example.com/hooks/gpu-portal")
    page.get_by_role("button", name="Add webhook").click()
    expect(page.locator("details.webhook")).to_have_count(1)
    page.locator("details.webhook summary").click()
    asked = []

    def answer(accept):
        def on_dialog(dialog):
            asked.append(dialog.message)
            dialog.accept() if accept else dialog.dismiss()
        return on_dialog

    page.once("dialog", answer(False))
    page.get_by_role("button", name="Delete").click()
    page.wait_for_timeout(300)
    assert len(asked) == 1 and "delete" in asked[0].lower(), asked
    assert Channel.objects.filter(tenant=world.tenants["alpha"], kind="webhook").count() == 1
    page.once("dialog", answer(True))
    page.get_by_role("button", name="Delete").click()
    expect(page.get_by_text("Webhook deleted")).to_be_visible()
    assert Channel.objects.filter(tenant=world.tenants["alpha"], kind="webhook").count() == 0

    page.goto(f"{live_server.url}/")  # the dashboard's calendar-feed card
    feed = page.locator("input[readonly][value*='/ical/']")
    Tenant.objects.filter(pk=world.tenants["alpha"].pk).update(ical_token="a-feed-secret")
    page.reload()
    before = feed.input_value()
    page.once("dialog", answer(False))
    page.get_by_role("button", name="Issue new addresses to every member").click()
    page.wait_for_timeout(300)
    assert len(asked) == 3 and "calendar" in asked[2].lower(), asked
    assert Tenant.objects.get(pk=world.tenants["alpha"].pk).ical_token == "a-feed-secret"
    page.once("dialog", answer(True))
    page.get_by_role("button", name="Issue new addresses to every member").click()
    expect(feed).not_to_have_value(before)
    assert Tenant.objects.get(pk=world.tenants["alpha"].pk).ical_token != "a-feed-secret"


def test_the_time_zone_can_be_saved_right_after_making_a_token(world, live_server, new_page, sign_in):
    """The time-zone form had no action: after "Create token" the page is the answer to /account/tokens/, so
    saving a new zone there posted to the token view instead. The zone was not saved, no token was made
    either, and the only sign was "This field is required." beside the token form's expiry."""
    from tenants.models import ApiToken

    page = sign_in(new_page(), "alpha-member")
    page.goto(f"{live_server.url}/account/")
    page.locator("#api-tokens").get_by_label("Name").fill("laptop")
    page.get_by_role("button", name="Create token").click()
    expect(page.locator("[data-new-token]")).to_be_visible()
    zone = page.get_by_role("combobox", name="Time zone")
    zone.select_option("Asia/Tokyo")
    page.get_by_role("region", name="Time zone").get_by_role("button", name="Save").click()
    expect(page.get_by_role("combobox", name="Time zone")).to_have_value("Asia/Tokyo")
    expect(page.locator("footer")).to_contain_text("Asia/Tokyo")
    assert ApiToken.objects.filter(user=world.users["alpha-member"], name="laptop").count() == 1


def test_a_cancelled_reservation_does_not_keep_the_reason_of_its_last_step(world, live_server, new_page, sign_in,
                                                                           day):
    """Cancelled while provisioning, a reservation's page said "Cancelled" and, beneath it in warning amber,
    "provisioning lead time reached": the reason of the step before, never cleared (the API said the same)."""
    from reservations import services
    from reservations.models import Reservation

    from .conftest import at

    mine = services.reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    services.reservation_set_status(reservation_id=mine.pk, status="provisioning", expected=("confirmed",),
                                    reason="provisioning lead time reached")
    page = sign_in(new_page(viewport=PHONE), "alpha-member")
    page.goto(f"{live_server.url}/reservations/{mine.pk}/")
    page.get_by_role("link", name="Cancel reservation…").click()
    page.get_by_role("button", name="Yes, cancel it").click()
    expect(page.locator(".messages li.success")).to_contain_text(f"Reservation #{mine.pk} cancelled")
    expect(page.get_by_text("provisioning lead time reached")).to_have_count(0)
    assert Reservation.objects.get(pk=mine.pk).status_reason == ""


def test_a_repairs_steps_are_in_the_readers_zone(world, live_server, new_page, sign_in):
    """A repair's steps were printed as stored, "2026-12-02T13:11:20 UTC", on a page whose footer says times
    are in the reader's zone and whose other times (the fleet, the node's checks) are."""
    page = sign_in(new_page(tz="Europe/Berlin", viewport=PHONE), "staff")
    page.goto(f"{live_server.url}/account/")
    page.get_by_role("combobox", name="Time zone").select_option("Asia/Tokyo")
    page.get_by_role("region", name="Time zone").get_by_role("button", name="Save").click()
    page.goto(f"{live_server.url}/health/nodes/h100-001/")
    page.get_by_label("Reason").fill("customer reports NCCL hangs")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Drain and open a repair").click()
    step = page.locator("ol.repair-steps li").first
    expect(step).to_contain_text("JST")
    assert "UTC" not in step.inner_text(), step.inner_text()


def test_a_button_pressed_after_the_session_ended_leads_back_to_its_page_after_sign_in(world, live_server, new_page,
                                                                                       sign_in, day):
    """With the session gone (expired, signed out in another tab), "+1 day" on a reservation sent the user to
    sign in with next=/reservations/N/extend/; signing in then fetched that POST-only address and the browser
    showed its own "HTTP ERROR 405" page. Every plain form on the portal did the same."""
    from reservations import services
    from reservations.models import Reservation

    from .conftest import PASSWORD, at

    mine = services.reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12))
    page = sign_in(new_page(), "alpha-member")
    page.goto(f"{live_server.url}/reservations/{mine.pk}/")
    kept = [c for c in page.context.cookies() if c["name"] != "sessionid"]
    page.context.clear_cookies()
    page.context.add_cookies(kept)
    page.get_by_role("button", name="+1 day").click()
    expect(page.locator(".messages")).to_contain_text("signed out, so that was not done")
    page.get_by_label("Username").fill("alpha-member")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{live_server.url}/reservations/{mine.pk}/")
    expect(page.get_by_role("heading", level=1)).to_contain_text(f"#{mine.pk}")
    assert Reservation.objects.get(pk=mine.pk).end == at(day, 12)  # nothing was done behind the user's back


def test_a_run_name_without_spaces_does_not_widen_the_reservation_pages_on_a_phone(world, live_server, new_page,
                                                                                  sign_in, day):
    """Run names are often one long token ("llama3_70b_finetune_lr3e5_…"): underscores give a line no place
    to break, so the reservation page's heading pushed the page 370px past a phone's screen (and the cancel
    question and the calendar's panel heading did the same)."""
    from reservations import services

    from .conftest import at

    name = "llama3_70b_finetune_lr3e5_bs1024_seq8192_run0042_final_v2_eval"
    mine = services.reservation_create(actor=world.users["alpha-member"], tenant=world.tenants["alpha"],
                                       pool=world.pool, node_count=1, start=at(day, 10), end=at(day, 12), name=name)
    page = sign_in(new_page(viewport=PHONE), "alpha-member")
    for path in (f"/reservations/{mine.pk}/", f"/reservations/{mine.pk}/cancel/"):
        page.goto(live_server.url + path)
        expect(page.locator("main")).to_contain_text(name)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{path} scrolls sideways by {overflow}px"
    page.goto(f"{live_server.url}/calendar/?view=timeGridDay&date={day.isoformat()}&pool=h100")
    page.wait_for_selector("#calendar[data-ready='1']")
    page.locator(f".fc-event[data-reservation-id='{mine.pk}']").click()
    expect(page.locator("#side-panel #panel-title")).to_contain_text(name)
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the calendar with the panel open scrolls sideways by {overflow}px"


def test_the_admin_pages_log_no_error_in_the_browsers_console(world, live_server, new_page, sign_in):
    """Every page of the Django admin (its sign-in page too) left "Failed to load resource: 404 (Not Found)" in
    the browser's console: with no icon named, the browser asked for /favicon.ico, which the portal does not
    serve. The portal's own pages name an empty icon; the admin's now do too."""
    anonymous = new_page()
    failures = []
    anonymous.on("console", lambda msg: failures.append(msg.text) if msg.type == "error" else None)
    anonymous.on("response", lambda r: failures.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    anonymous.goto(f"{live_server.url}/admin/login/")
    expect(anonymous.get_by_role("button", name="Log in")).to_be_visible()
    anonymous.wait_for_load_state("networkidle")
    assert failures == []

    page = sign_in(new_page(), "staff")
    page.on("console", lambda msg: failures.append(msg.text) if msg.type == "error" else None)
    page.on("response", lambda r: failures.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(f"{live_server.url}/admin/")
    expect(page.locator("#site-name")).to_be_visible()
    page.wait_for_load_state("networkidle")
    assert failures == []
