"""The reservation page, the calendar's side panel, extend and cancel (with confirmation)."""

from __future__ import annotations

import re
import zoneinfo
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from django.utils.formats import date_format

from reservations import services
from tests.conftest import iso, next_fall_back

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def test_page_shows_nodes_timeline_and_the_cluster_block(world, web, book, t0):
    r = book("alpha-lead", t0, nodes=2, name="pretrain")
    page = web("alpha-viewer").get(f"/reservations/{r.pk}/").content.decode()
    for hostname in r.allocations.values_list("node__hostname", flat=True):
        assert hostname in page
    assert "Status timeline" in page and "Booked" in page and "by alpha-lead" in page
    assert re.search(r'data-status="confirmed"[^>]*aria-current="step">Confirmed<', page)
    assert 'data-placeholder="cluster-phases"' in page and 'data-placeholder="credentials"' in page
    assert 'data-placeholder="health"' in page
    assert "16 GPUs" in page


def test_other_tenants_reservations_are_404_everywhere(world, web, book, t0):
    r = book("beta-lead", t0, name="beta-secret")
    client = web("alpha-lead")
    for url in (f"/reservations/{r.pk}/", f"/reservations/{r.pk}/panel/", f"/reservations/{r.pk}/cancel/"):
        response = client.get(url)
        assert response.status_code == 404 and b"beta-secret" not in response.content
    assert client.post(f"/reservations/{r.pk}/cancel/").status_code == 404
    assert client.post(f"/reservations/{r.pk}/extend/", {"end": iso(r.end + timedelta(hours=1))}).status_code == 404
    r.refresh_from_db()
    assert r.status == "confirmed"


def test_controls_follow_the_role(world, web, book, t0):
    leads = book("alpha-lead", t0)
    assert b"Cancel reservation" in web("alpha-lead").get(f"/reservations/{leads.pk}/").content
    assert b"Cancel reservation" not in web("alpha-member").get(f"/reservations/{leads.pk}/").content
    assert b"Cancel reservation" not in web("alpha-viewer").get(f"/reservations/{leads.pk}/").content
    members = book("alpha-member", t0 + timedelta(hours=4))
    assert b"Cancel reservation" in web("alpha-member").get(f"/reservations/{members.pk}/").content


def test_extend_goes_through_the_service(world, web, book, t0):
    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    response = client.post(f"/reservations/{r.pk}/extend/", {"end": iso(r.end + timedelta(hours=4))})
    assert response.status_code == 302
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=6)
    page = client.get(f"/reservations/{r.pk}/").content.decode()
    assert "now ends" in page and "end " in page  # the message, and the change in the timeline


def test_each_extend_button_says_the_end_it_would_give_in_the_readers_zone(world, web, book, t0):
    """The buttons said "+1 slot", "+4 hours", "+1 day" but not the end each would give: the reader had to
    add it up (in their own zone). Each button's text, and so its accessible name, now includes it."""
    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Europe/Berlin"})
    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    slot = timedelta(minutes=world.pool.slot_minutes)
    for url in (f"/reservations/{r.pk}/", f"/reservations/{r.pk}/panel/"):
        page = client.get(url, **HTMX).content.decode()
        buttons = {label: re.sub(r"<[^>]+>|\s+", " ", inner).split()
                   for label, inner in re.findall(r'<button type="submit" name="end" value="[^"]*"[^>]*>'
                                                  r'\s*(\+1 slot|\+4 hours|\+1 day)(.*?)</button>', page, re.S)}
        assert set(buttons) == {"+1 slot", "+4 hours", "+1 day"}, url
        for label, delta in (("+1 slot", slot), ("+4 hours", timedelta(hours=4)), ("+1 day", timedelta(days=1))):
            local = (r.end + delta).astimezone(berlin)
            assert " ".join(buttons[label]) == f"(ends {local:%a} {local.day} {local:%b %H:%M %Z})", (url, label)


def test_extend_into_a_conflict_is_refused_with_the_reason(world, web, book, t0):
    r = book("alpha-lead", t0, nodes=2)
    book("beta-lead", r.end, nodes=3)
    book("beta-member", r.end, nodes=1)
    client = web("alpha-lead")
    # The refusal comes back as the page itself (the value kept, the reason beside the field), not a redirect.
    response = client.post(f"/reservations/{r.pk}/extend/", {"end": iso(r.end + timedelta(hours=1))})
    assert response.status_code == 409
    page = response.content.decode()
    assert "Not changed:" in page and "free" in page  # the service's reason: too few free nodes
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=2)
    assert "Not changed:" not in client.get(f"/reservations/{r.pk}/").content.decode()  # said once, not queued


def test_member_cannot_cancel_a_leads_booking_even_by_posting(world, web, book, t0):
    r = book("alpha-lead", t0)
    client = web("alpha-member")
    client.post(f"/reservations/{r.pk}/cancel/")
    assert "Not cancelled" in client.get(f"/reservations/{r.pk}/").content.decode()
    r.refresh_from_db()
    assert r.status == "confirmed"


def test_a_refused_cancel_in_the_panel_says_so_there_and_nowhere_else(world, web, book, t0):
    r = book("alpha-lead", t0)
    client = web("alpha-member")
    response = client.post(f"/reservations/{r.pk}/cancel/", **HTMX)
    assert response.status_code == 200 and "HX-Trigger" not in response
    assert "Not cancelled: Members can change only their own reservations" in response.content.decode()
    assert "Not cancelled" not in client.get("/availability/").content.decode()  # no leftover message
    r.refresh_from_db()
    assert r.status == "confirmed"


def test_cancel_asks_first_then_frees_the_nodes(world, web, book, t0):
    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    confirm = client.get(f"/reservations/{r.pk}/cancel/").content.decode()
    assert "Cancel reservation #" in confirm and "Yes, cancel it" in confirm
    r.refresh_from_db()
    assert r.status == "confirmed"  # asking changed nothing
    response = client.post(f"/reservations/{r.pk}/cancel/", **HTMX)
    # said after the swap (htmx then dispatches it on the body when the Cancel link is gone), not on receipt
    assert response.status_code == 200 and "reservation-changed" in response["HX-Trigger-After-Swap"]
    assert "HX-Trigger" not in response
    assert 'badge st-cancelled' in response.content.decode()
    assert "cancelled; its nodes are free again" in response.content.decode()
    assert "free again" not in client.get("/").content.decode()  # said in the panel, not queued
    r.refresh_from_db()
    assert r.status == "cancelled" and not r.allocations.filter(active=True).exists()


def test_dashboard_shows_upcoming_quota_meters_and_activity(world, web, book, t0):
    r = book("alpha-lead", t0, nodes=2, name="visible-run")
    book("beta-lead", t0, name="beta-secret")
    page = web("alpha-viewer").get("/").content.decode()
    assert "visible-run" in page and "beta-secret" not in page
    assert f'data-reservation-id="{r.pk}"' in page
    assert 'aria-valuenow="2"' in page  # peak over the next 14 days: the 2-node booking
    assert 'aria-valuemax="4"' in page  # 3 guaranteed + 1 burst
    assert f"Booked <a href=\"/reservations/{r.pk}/\">#{r.pk}</a>" in page  # the activity, in words


def test_pages_work_for_a_user_without_tenants(world, django_user_model, client):
    loner = django_user_model.objects.create_user(username="loner", password="pw-Long-enough-1")
    client.force_login(loner)
    assert b"not a member of any tenant" in client.get("/").content
    assert client.get("/calendar/").status_code == 200
    assert client.get("/calendar/events.json", {"start": "2030-01-01T00:00:00Z",
                                                "end": "2030-01-02T00:00:00Z"}).json() == []
    assert client.get("/reservations/new/").status_code == 403


def test_a_booking_whose_cluster_is_being_torn_down_offers_no_window_change(world, web, book, t0):
    """An early teardown leaves the booking ending until its booked end: the service refuses any new end
    for it, so the page, the panel and the calendar must not offer extend buttons, the end field or
    drag/resize that can only fail. Cancelling it (freeing the paid-for nodes) still works."""
    from reservations.models import Reservation

    r = book("alpha-lead", t0)
    Reservation.objects.filter(pk=r.pk).update(status="ending")
    client = web("alpha-lead")
    for url in (f"/reservations/{r.pk}/", f"/reservations/{r.pk}/panel/"):
        page = client.get(url).content.decode()
        assert "+1 slot" not in page and "Change end" not in page, url
        assert "Cancel reservation" in page, url
    (event,) = client.get("/calendar/events.json", {"start": iso(t0 - timedelta(days=1)),
                                                    "end": iso(t0 + timedelta(days=1))}).json()
    assert not event.get("durationEditable") and not event.get("startEditable")
    client.post(f"/reservations/{r.pk}/extend/", {"end": iso(r.end + timedelta(hours=1))})
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=2)  # what the controls would have asked: always refused


KOLKATA = zoneinfo.ZoneInfo("Asia/Kolkata")
NEW_YORK = zoneinfo.ZoneInfo("America/New_York")


def _end_field(page: str, pk: int) -> dict[str, str]:
    """The "New end" form's inputs (name -> value) and the text of the errors beside it."""
    form = re.search(rf'<form[^>]*action="/reservations/{pk}/extend/"[^>]*>(?:(?!</form>).)*?<input[^>]*name="end"'
                     r'(?:(?!</form>).)*</form>', page, re.S)
    assert form, "no New end form"
    html = form.group(0)
    found = {m.group(1): m.group(2) for m in re.finditer(r'<input[^>]*?name="(end|end_offset)"[^>]*?value="([^"]*)"',
                                                        html)}
    errors = re.search(rf'id="extend-end-{pk}_error"[^>]*>(.*?)</ul>', html, re.S)
    found["errors"] = re.sub(r"<[^>]+>", " ", errors.group(1)) if errors else ""
    found["invalid"] = 'aria-invalid="true"' in html and f'aria-describedby="extend-end-{pk}_error"' in html
    return found


def test_a_refused_new_end_comes_back_with_what_was_typed_and_the_reason_beside_it(world, web, book, t0):
    """The page redirected back with a message at the top and the field reset to end + one slot: the
    user lost what they typed and had to find out why somewhere else on the page."""
    r = book("alpha-lead", t0, nodes=2)
    book("beta-lead", r.end, nodes=3)  # from its end on, only 1 node is free: 2 cannot stay longer
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Asia/Kolkata"})
    typed = (r.end + timedelta(hours=3)).astimezone(KOLKATA).strftime("%Y-%m-%dT%H:%M")
    response = client.post(f"/reservations/{r.pk}/extend/", {"end": typed})
    assert response.status_code == 409
    field = _end_field(response.content.decode(), r.pk)
    assert field["end"] == typed, field  # what was typed, in the user's zone
    assert "Not changed:" in field["errors"] and "free" in field["errors"], field
    assert field["invalid"], field
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=2)

    # An end off the pool's grid (the service's reason), and one the form cannot read, come back the same way.
    off_grid = (r.end + timedelta(minutes=90)).astimezone(KOLKATA).strftime("%Y-%m-%dT%H:%M")
    response = client.post(f"/reservations/{r.pk}/extend/", {"end": off_grid})
    assert response.status_code == 400
    field = _end_field(response.content.decode(), r.pk)
    assert field["end"] == off_grid and "Not changed:" in field["errors"] and field["invalid"], field
    response = client.post(f"/reservations/{r.pk}/extend/", {"end": "next tuesday"})
    assert response.status_code == 400
    field = _end_field(response.content.decode(), r.pk)
    assert field["end"] == "next tuesday" and "Enter a date and time" in field["errors"] and field["invalid"], field
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=2)

    # Whoever gets no field (a member, on the lead's booking) still reads the reason, on the page itself.
    response = web("alpha-member").post(f"/reservations/{r.pk}/extend/", {"end": typed})
    assert response.status_code == 403
    assert "Not changed: Members can change only their own reservations" in response.content.decode()
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=2)



def test_new_end_in_the_repeated_hour_says_which_one_it_is(world, web, settings):
    """On New York's fall-back day 01:00-02:00 happens twice. A booking ending at the first 01:00 (EDT)
    offers the second 01:00 (EST) as its new end; the field sent it without an offset, so "Change end"
    with the value the page itself filled in was refused as skipped or repeated."""
    from reservations import services

    settings.PORTAL_BOOKING_HORIZON_DAYS = 400  # the next fall-back day may be a year and a few days away
    day = next_fall_back(NEW_YORK)
    first_one = datetime(day.year, day.month, day.day, 5, tzinfo=UTC)  # 01:00 EDT
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                    pool=world.pool, node_count=1, start=first_one - timedelta(hours=1),
                                    end=first_one, name="over-the-fold")
    client = web("alpha-lead")
    client.post("/account/", {"tz": "America/New_York"})
    field = _end_field(client.get(f"/reservations/{r.pk}/").content.decode(), r.pk)
    assert field["end"] == f"{day}T01:00" and field.get("end_offset") == "-05:00", field
    response = client.post(f"/reservations/{r.pk}/extend/", {"end": field["end"], "end_offset": field["end_offset"]})
    assert response.status_code == 302, _end_field(response.content.decode(), r.pk)
    r.refresh_from_db()
    assert r.end == first_one + timedelta(hours=1)  # 01:00 EST, the second one


def test_a_cancelled_booking_without_a_cluster_does_not_promise_one(world, web, book, t0):
    """The reservation page of a booking cancelled before its cluster was made still said its phases "will be
    shown here once the cluster is being built", its credentials "will be available here when the cluster is
    ready" and health results "will appear here": nothing will ever be built for it."""
    from reservations import services

    r = book("alpha-lead", t0, nodes=1, name="changed-my-mind")
    services.reservation_cancel(actor=world.users["alpha-lead"], reservation=r)
    html = web("alpha-lead").get(f"/reservations/{r.pk}/").content.decode()
    cluster = html[html.index('id="cluster-title"'):]
    cluster = cluster[:cluster.index("</section>")]
    assert "will be shown here" not in cluster and "will be available" not in cluster, cluster
    assert "will appear here" not in cluster
    assert "No cluster" in cluster and "cancelled" in cluster


def test_the_lifecycle_pills_are_words_not_status_codes(world, web, book, t0):
    """The reservation page's lifecycle showed the stored codes ("confirmed", "provisioning") where the status
    badge beside it says "Confirmed". The pills say the words; each keeps its code in data-status."""
    r = book("alpha-lead", t0, name="pills")
    page = web("alpha-lead").get(f"/reservations/{r.pk}/").content.decode()
    lifecycle = page[page.index('<ol class="lifecycle"'):]
    lifecycle = lifecycle[:lifecycle.index("</ol>")]
    pills = re.findall(r'<li data-status="(\w+)"[^>]*>([^<]*)</li>', lifecycle)
    assert pills == [("confirmed", "Confirmed"), ("provisioning", "Provisioning"), ("active", "Active"),
                     ("ending", "Ending"), ("completed", "Completed")], lifecycle
    assert re.search(r'data-status="confirmed"[^>]*aria-current="step"', lifecycle)
    r.status = "cancelled"
    r.save(update_fields=["status"])
    lifecycle = web("alpha-lead").get(f"/reservations/{r.pk}/").content.decode()
    assert re.search(r'<li data-status="cancelled"[^>]*aria-current="step"[^>]*>Cancelled</li>', lifecycle)


def test_a_booking_can_be_renamed_from_its_page(world, web, book, t0):
    """The service and the API rename a booking; its page offered no way to, so a lead had to use the API."""
    r = book("alpha-lead", t0, name="pretrain")
    client = web("alpha-lead")
    page = client.get(f"/reservations/{r.pk}/").content.decode()
    form = re.search(rf'<form[^>]*action="/reservations/{r.pk}/rename/"(?:(?!</form>).)*</form>', page, re.S)
    assert form and 'name="name"' in form.group(0) and 'value="pretrain"' in form.group(0)
    assert re.search(rf'<label for="rename-name-{r.pk}">', page)
    response = client.post(f"/reservations/{r.pk}/rename/", {"name": "pretrain run 8"})
    assert response.status_code == 302 and response["Location"] == f"/reservations/{r.pk}/"
    r.refresh_from_db()
    assert r.name == "pretrain run 8"
    assert "renamed to “pretrain run 8”" in client.get(f"/reservations/{r.pk}/").content.decode()


def test_a_refused_name_keeps_what_was_typed_with_the_reason_beside_it(world, web, book, t0):
    r = book("alpha-lead", t0, name="pretrain")
    response = web("alpha-lead").post(f"/reservations/{r.pk}/rename/", {"name": "bad\x07name"})
    assert response.status_code == 400
    html = response.content.decode()
    assert 'value="bad\x07name"' in html or "bad&#x07;name" in html or "bad\x07name" in html
    assert re.search(rf'id="rename-name-{r.pk}_error"[^>]*>.*Not renamed: Control characters', html, re.S)
    r.refresh_from_db()
    assert r.name == "pretrain"


def test_only_who_may_change_a_booking_can_rename_it(world, web, book, t0):
    r = book("alpha-lead", t0, name="pretrain")
    assert b"/rename/" not in web("alpha-viewer").get(f"/reservations/{r.pk}/").content
    assert web("alpha-viewer").post(f"/reservations/{r.pk}/rename/", {"name": "x"}).status_code in (403, 404)
    assert web("beta-lead").post(f"/reservations/{r.pk}/rename/", {"name": "x"}).status_code == 404
    r.refresh_from_db()
    assert r.name == "pretrain"


def _extend_forms(html: str, pk: int) -> list[dict]:
    """Each extend form of a page as a browser would post it: its inputs, and each submit button's name/value."""
    forms = []
    for body in re.findall(rf'<form[^>]*action="/reservations/{pk}/extend/"[^>]*>(.*?)</form>', html, re.S):
        fields = {name: value for name, value in re.findall(r'<input[^>]*name="([^"]+)"[^>]*value="([^"]*)"', body)}
        buttons = re.findall(r'<button[^>]*name="([^"]+)"[^>]*value="([^"]*)"', body)
        forms.append({"fields": fields, "buttons": buttons})
    return forms


def test_a_stale_extend_button_never_shortens_a_booking_changed_since(world, web, book, t0):
    # The panel was opened when the booking ended at t0+2h; meanwhile another lead extended it to t0+6h.
    # "+1 slot (ends t0+3h)" on the stale panel used to set the end to t0+3h: three hours cut off a booking
    # the user meant to lengthen, with "now ends …" as the only hint.
    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    buttons, field = _extend_forms(client.get(f"/reservations/{r.pk}/panel/").content.decode(), r.pk)
    services.reservation_update(actor=world.users["alpha-lead"], reservation=r, end=t0 + timedelta(hours=6))
    name, value = buttons["buttons"][0]
    response = client.post(f"/reservations/{r.pk}/extend/", {**buttons["fields"], name: value})
    assert response.status_code == 409
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=6)
    assert "changed since you opened this page" in response.content.decode()
    # The typed new end on the same stale page is refused the same way.
    typed = {**field["fields"], "end": (t0 + timedelta(hours=4)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M")}
    response = client.post(f"/reservations/{r.pk}/extend/", typed)
    assert response.status_code == 409
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=6)
    # A fresh page extends as before.
    buttons, _ = _extend_forms(client.get(f"/reservations/{r.pk}/").content.decode(), r.pk)
    name, value = buttons["buttons"][0]
    assert client.post(f"/reservations/{r.pk}/extend/", {**buttons["fields"], name: value}).status_code == 302
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=7)


def test_a_mangled_shown_end_is_refused_beside_the_field_and_changes_nothing(world, web, book, t0):
    r = book("alpha-lead", t0)
    response = web("alpha-lead").post(f"/reservations/{r.pk}/extend/",
                                      {"end": iso(r.end + timedelta(hours=1)), "shown_end": "yesterday"})
    assert response.status_code == 400
    assert "This page is out of date" in response.content.decode()
    r.refresh_from_db()
    assert r.end == t0 + timedelta(hours=2)


def _rename_form_fields(html: str, pk: int) -> dict:
    """The rename form's inputs as a browser would post them."""
    body = re.search(rf'<form[^>]*action="/reservations/{pk}/rename/"[^>]*>(.*?)</form>', html, re.S).group(1)
    return {name: value for name, value in re.findall(r'<input[^>]*name="([^"]+)"[^>]*value="([^"]*)"', body)}


def test_a_stale_rename_never_overwrites_a_rename_made_since(world, web, book, t0):
    # The page was opened when the booking was "pretrain"; meanwhile another lead renamed it "pretrain run 7".
    # Renaming from the stale page used to overwrite that name without a word.
    r = book("alpha-lead", t0, name="pretrain")
    client = web("alpha-lead")
    fields = _rename_form_fields(client.get(f"/reservations/{r.pk}/").content.decode(), r.pk)
    assert fields.get("shown_name") == "pretrain"
    services.reservation_update(actor=world.users["alpha-lead"], reservation=r, name="pretrain run 7")
    response = client.post(f"/reservations/{r.pk}/rename/", {**fields, "name": "my run"})
    assert response.status_code == 409
    html = response.content.decode()
    assert re.search(rf'id="rename-name-{r.pk}_error"[^>]*>.*Not renamed: .*changed since you opened this page',
                     html, re.S)
    r.refresh_from_db()
    assert r.name == "pretrain run 7"
    # A booking without a name shows an empty one, which is checked too (an empty name is a name shown).
    services.reservation_update(actor=world.users["alpha-lead"], reservation=r, name="")
    fields = _rename_form_fields(client.get(f"/reservations/{r.pk}/panel/").content.decode(), r.pk)
    assert fields.get("shown_name") == ""
    services.reservation_update(actor=world.users["alpha-lead"], reservation=r, name="theirs")
    assert client.post(f"/reservations/{r.pk}/rename/", {**fields, "name": "mine"}).status_code == 409
    r.refresh_from_db()
    assert r.name == "theirs"
    # A fresh page renames as before.
    fields = _rename_form_fields(client.get(f"/reservations/{r.pk}/").content.decode(), r.pk)
    assert client.post(f"/reservations/{r.pk}/rename/", {**fields, "name": "mine"}).status_code == 302
    r.refresh_from_db()
    assert r.name == "mine"


def test_extend_message_writes_the_new_end_as_the_pages_do(world, web, book):
    """The message after an extension read "now ends Sun 06 Dec 20:00 CET" under buttons saying
    "ends Sun 6 Dec 20:00 CET": a zero-padded day nowhere else on the pages."""
    today = timezone.now().date()
    first = (today.replace(day=1) + timedelta(days=62)).replace(day=1)  # the 1st, a month or two ahead
    start = datetime(first.year, first.month, 1, 9, tzinfo=UTC)
    r = book("alpha-lead", start)
    client = web("alpha-lead")
    client.post("/account/", {"tz": "Europe/Berlin"})
    client.post(f"/reservations/{r.pk}/extend/", {"end": iso(r.end + timedelta(hours=1))})
    r.refresh_from_db()
    shown = date_format(timezone.localtime(r.end, zoneinfo.ZoneInfo("Europe/Berlin")), "D j M H:i T")
    page = client.get(f"/reservations/{r.pk}/").content.decode()
    assert f"Reservation #{r.pk} now ends {shown}." in page, re.findall(r"now ends[^<]*", page)


def test_the_pages_cluster_poll_brings_the_status_parts_only_when_the_status_moved_on(world, web, book, t0):
    """The reservation page's cluster card polls the page itself, saying the status it shows: the answer is the card
    (with the credentials and actions beside it), and the badge, lifecycle and booking actions out-of-band only when
    the booking's status is no longer that one, so a name or end being typed beside them is not wiped every poll."""
    from provisioning.services import cluster_create_for_reservation
    from reservations.models import Reservation

    r = book("alpha-lead", t0)
    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    client = web("alpha-lead")
    page = client.get(f"/reservations/{r.pk}/").content.decode()
    card = re.search(r'<section[^>]*id="cluster-status"[^>]*>', page).group(0)
    assert re.search(rf'hx-get="/reservations/{r.pk}/\?shown=confirmed&amp;nodes=[0-9a-f]{{8}}'
                     r'&amp;timeline=[0-9a-f]{16}"', card) and 'hx-trigger="every 3s"' in card, card
    assert 'id="reservation-status-badge"' in page and 'id="reservation-actions"' in page

    same = client.get(f"/reservations/{r.pk}/", {"shown": "confirmed"}, **HTMX)
    assert same.status_code == 200 and "HX-Request" in same["Vary"]
    body = same.content.decode()
    assert 'id="cluster-status"' in body and 'id="cluster-credentials" hx-swap-oob="true"' in body
    assert "reservation-status-badge" not in body and "reservation-actions" not in body and "<h1" not in body

    Reservation.objects.filter(pk=r.pk).update(status="provisioning")
    moved = client.get(f"/reservations/{r.pk}/", {"shown": "confirmed"}, **HTMX).content.decode()
    for part in ("reservation-status-badge", "reservation-lifecycle", "reservation-actions"):
        assert f'id="{part}" hx-swap-oob="true"' in moved, part
    assert 'class="badge st-provisioning"' in moved
    assert re.search(r'data-status="provisioning"[^>]*aria-current="step"', moved)
    assert f'hx-get="/reservations/{r.pk}/?shown=provisioning&amp;' in moved  # the next poll says what it now shows
    # the cluster page's own card still polls the cluster page
    assert f'hx-get="/clusters/{cluster.pk}/"' in client.get(f"/clusters/{cluster.pk}/").content.decode()


def _poll_url(body: str) -> str:
    """The URL the cluster card polls next (as the browser reads the attribute)."""
    import html

    return html.unescape(re.search(r'<section[^>]*id="cluster-status"[^>]*hx-get="([^"]*)"', body).group(1))


def test_the_pages_poll_brings_the_nodes_and_timeline_only_when_they_changed(world, web, book, t0):
    """A lead watching an active booking's page while a node failed its health checks and was drained and replaced
    (its allocation moved to a spare) kept seeing the old node in the Nodes card, and no swap in the timeline,
    until a reload: the page's poll brought only the cluster card and the status parts, and it stopped polling
    once the booking was active. The poll now says which nodes and which timeline the page shows; the answer
    brings the Nodes card's list and the timeline out-of-band when they are no longer those (not every poll),
    and an active booking's page goes on polling, more slowly, while its nodes can still change."""
    from provisioning.models import VirtualCluster
    from provisioning.services import cluster_create_for_reservation
    from reservations.models import Reservation
    from reservations.services import node_replace_allocations, node_update

    r = book("alpha-lead", t0)
    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    Reservation.objects.filter(pk=r.pk).update(status="active")
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="ready")
    (old,) = [a.node for a in r.allocations.filter(active=True).select_related("node")]
    client = web("alpha-viewer")  # a viewer sees the booking's nodes as the page shows them
    page = client.get(f"/reservations/{r.pk}/").content.decode()
    card = re.search(r'<section[^>]*id="cluster-status"[^>]*>', page).group(0)
    # active, its cluster handed over: the card still polls (its nodes can be swapped), but slowly
    assert 'hx-trigger="every 15s"' in card, card
    url = _poll_url(page)
    assert url.startswith(f"/reservations/{r.pk}/?shown=active&nodes=") and "&timeline=" in url, url
    assert re.search(r'<section[^>]*aria-labelledby="nodes-title"[^>]*>\s*<h2 id="nodes-title">Nodes</h2>\s*'
                     r'<div id="reservation-nodes" aria-live="polite">', page)
    assert re.search(r'<section[^>]*aria-labelledby="timeline-title"[^>]*>\s*<h2 id="timeline-title">'
                     r'Status timeline</h2>\s*<ul id="reservation-timeline"', page)

    same = client.get(url, **HTMX)
    assert same.status_code == 200
    body = same.content.decode()
    assert 'id="cluster-status"' in body
    assert "reservation-nodes" not in body and "reservation-timeline" not in body, body
    assert _poll_url(body) == url

    node_update(actor=world.users["staff"], node=old, state="draining", reason="health check failed")
    draining = client.get(url, **HTMX).content.decode()
    nodes = re.search(r'<div id="reservation-nodes" hx-swap-oob="innerHTML">(.*?)</div>', draining, re.S).group(1)
    assert old.hostname in nodes and "Draining" in nodes, nodes
    assert "reservation-timeline" not in draining  # the booking's record did not change
    url = _poll_url(draining)

    (outcome,) = node_replace_allocations(node=old, reason="XID 79")
    assert outcome["result"] == "replaced"
    spare = outcome["spare"]
    swapped = client.get(url, **HTMX).content.decode()
    nodes = re.search(r'<div id="reservation-nodes" hx-swap-oob="innerHTML">(.*?)</div>', swapped, re.S).group(1)
    assert spare in nodes and old.hostname not in nodes, nodes
    timeline = re.search(r'<ul id="reservation-timeline" class="timeline" hx-swap-oob="innerHTML">(.*?)</ul>',
                         swapped, re.S).group(1)
    assert "Node replaced" in timeline and f"{old.hostname} → {spare}" in timeline, timeline
    assert "XID" not in timeline  # the reason stays with staff
    # the status did not move: the badge and the booking's actions (a form being typed in) are left alone
    assert "reservation-status-badge" not in swapped and "reservation-actions" not in swapped
    url = _poll_url(swapped)
    settled = client.get(url, **HTMX).content.decode()
    assert "reservation-nodes" not in settled and "reservation-timeline" not in settled
    assert spare in client.get(f"/reservations/{r.pk}/").content.decode()

    # another tenant's poll learns nothing
    assert web("beta-lead").get(url, **HTMX).status_code == 404


def test_the_pages_poll_stops_once_the_booking_is_over(world, web, book, t0):
    """The slower poll of an active booking's nodes ends with the booking: an ended one's page does not poll."""
    from provisioning.models import VirtualCluster
    from provisioning.services import cluster_create_for_reservation
    from reservations.models import Reservation

    r = book("alpha-lead", t0)
    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="ready")
    Reservation.objects.filter(pk=r.pk).update(status="completed")
    page = web("alpha-lead").get(f"/reservations/{r.pk}/").content.decode()
    assert 'id="cluster-status"' in page and "hx-trigger" not in page


def test_the_pages_poll_says_when_a_failed_node_found_no_spare(world, web, book, t0):
    """A node failing under an active booking with no spare free leaves it a node short: the poll brings the Nodes
    card saying so, and the timeline entry names the node lost."""
    from provisioning.services import cluster_create_for_reservation
    from reservations.models import Reservation
    from reservations.services import node_replace_allocations, node_update

    r = book("alpha-lead", t0)
    cluster_create_for_reservation(reservation_id=r.pk)
    Reservation.objects.filter(pk=r.pk).update(status="active")
    (old,) = [a.node for a in r.allocations.filter(active=True).select_related("node")]
    for node in world.nodes:
        if node.pk != old.pk:
            node_update(actor=world.users["staff"], node=node, state="maintenance")
    client = web("alpha-lead")
    url = _poll_url(client.get(f"/reservations/{r.pk}/").content.decode())
    node_update(actor=world.users["staff"], node=old, state="failed")
    (outcome,) = node_replace_allocations(node=old)
    assert outcome["result"] == "degraded"
    body = client.get(url, **HTMX).content.decode()
    nodes = re.search(r'<div id="reservation-nodes" hx-swap-oob="innerHTML">(.*?)</div>', body, re.S).group(1)
    assert "No nodes held" in nodes and "1 node short: no spare node was free to replace it." in nodes, nodes
    assert f"{old.hostname} → no spare free" in body


def test_the_pages_poll_does_not_show_the_portal_wide_audit_sequence(world, web, book, t0, settings):
    """The poll's timeline marker was "<entries>-<last audit row id>": the audit log's ids are one sequence for the
    whole portal, so any member or viewer could read it off the page, touch their own booking (a rename) and read
    it again, and learn how much every other tenant and staff did in between. The marker now says only whether the
    timeline changed: a digest keyed with the site's secret, from which no id can be read back."""
    import html as html_lib

    from portal.core.models import AuditLog
    from provisioning.services import cluster_create_for_reservation

    r = book("alpha-lead", t0)
    cluster_create_for_reservation(reservation_id=r.pk)
    client = web("alpha-viewer")
    url = _poll_url(client.get(f"/reservations/{r.pk}/").content.decode())
    timeline = re.search(r"[?&]timeline=([^&]*)", html_lib.unescape(url)).group(1)
    last = AuditLog.objects.filter(object_type="reservations.reservation", object_id=str(r.pk)).order_by(
        "created_at", "id").last()
    assert last is not None
    assert not re.search(rf"(?<![0-9a-f]){last.pk}(?![0-9a-f])", timeline), timeline
    # keyed: the same timeline under another secret gives another marker (not an encoding of the id)
    settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]  # the viewer stays signed in
    settings.SECRET_KEY = settings.SECRET_KEY + "-other"
    other = re.search(r"[?&]timeline=([^&]*)",
                      _poll_url(client.get(f"/reservations/{r.pk}/").content.decode())).group(1)
    assert other != timeline
    # and the poll still brings the timeline only when it changed
    same = client.get(f"/reservations/{r.pk}/?shown={r.status}&nodes=x&timeline={other}", **HTMX).content.decode()
    assert "reservation-timeline" not in same
    moved = client.get(f"/reservations/{r.pk}/?shown={r.status}&nodes=x&timeline={timeline}", **HTMX).content.decode()
    assert "reservation-timeline" in moved
