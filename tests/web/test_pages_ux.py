"""Pages (Django test client): no pool silently preselected, local times in the timeline,
a refused webhook URL keeping what the lead typed, the audit page dressed like the others."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from notifications.models import Channel
from reservations import services
from reservations.models import Pool

pytestmark = pytest.mark.django_db


def _select(html: str, name: str) -> str:
    return re.search(rf'<select name="{name}"[^>]*>(.*?)</select>', html, re.S).group(1)


def test_booking_form_for_a_pool_without_quota_does_not_silently_book_another(world, web):
    """The calendar lists every pool; the form only the tenant's quota pools. Dragging across a100's shading
    opened a form whose pool box quietly showed h100 (the first option), and Book booked h100 nodes."""
    Pool.objects.create(name="a100", gpu_model="A100", gpus_per_node=8, on_demand_rate="1.5")  # no alpha quota
    html = web("alpha-lead").get("/reservations/new/", {"pool": "a100"}).content.decode()
    options = re.findall(r'<option value="([^"]*)"', _select(html, "pool"))
    assert options[0] == "", options  # nothing preselected: Book asks for a pool instead of booking h100
    assert re.search(r"no quota in a100", html, re.I), "the form should say why a100 is not offered"


def test_status_timeline_shows_a_changed_end_in_the_users_zone(world, web, t0):
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=1, start=t0, end=t0 + timedelta(hours=2), name="tz-run")
    services.reservation_update(actor=world.users["alpha-lead"], reservation=r, end=t0 + timedelta(hours=4))
    client = web("alpha-lead")
    session = client.session
    session["portal_tz"] = "America/New_York"
    session.save()
    html = client.get(f"/reservations/{r.pk}/").content.decode()
    timeline = html[html.index('id="timeline-title"'):]
    timeline = timeline[:timeline.index("</section>")]
    assert "Z →" not in timeline and not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", timeline), timeline
    from zoneinfo import ZoneInfo
    local_end = (t0 + timedelta(hours=4)).astimezone(ZoneInfo("America/New_York"))
    assert f"{local_end:%H:%M}" in timeline


def test_a_refused_webhook_url_keeps_what_the_lead_typed(world, web, settings):
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    response = web("alpha-lead").post("/notifications/webhooks/", {
        "name": "ci-hook", "url": "http://10.1.2.3/hooks/gpu", "events": ["reservation.confirmed"],
    }, follow=True)
    html = response.content.decode()
    assert not Channel.objects.filter(name="ci-hook").exists()
    assert "public addresses" in html  # the reason is shown …
    assert 'value="ci-hook"' in html and 'value="http://10.1.2.3/hooks/gpu"' in html  # … next to what was typed
    assert response.redirect_chain == []  # re-rendered, not redirected to an empty form


def test_audit_page_keeps_the_portal_header_and_says_which_zone_it_shows(world, web):
    """The audit page rendered without the portal context: on it a lead's nav lost the Notifications and
    Audit links, the header lost the tenant and role, and nothing said in which zone its times are."""
    client = web("alpha-lead")
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    html = client.get("/audit/").content.decode()
    assert 'href="/notifications/"' in html and 'aria-current="page">Audit</a>' in html
    assert 'data-role="lead"' in html
    assert "Times are shown in" in html and "Asia/Tokyo" in html


def test_audit_paging_keeps_the_filters_encoded(world, web):
    from portal.core.models import AuditLog
    from portal.core.views import PAGE_SIZE

    AuditLog.objects.bulk_create([AuditLog(action="node.maintenance", object_type="x", object_id=str(i))
                                  for i in range(PAGE_SIZE + 5)])  # fleet changes: no tenant
    html = web("staff").get("/audit/", {"all": "1", "action": "node.maint"}).content.decode()
    (older,) = re.findall(r'href="\?([^"]*page=2)"', html)
    assert "all=1" in older and "action=node.maint" in older
    second = web("staff").get("/audit/?" + older.replace("&amp;", "&")).content.decode()
    assert "page 2 of 2" in second


def test_the_heatmap_refresh_line_is_not_announced_every_30_seconds(world, web):
    html = web("alpha-viewer").get("/availability/grid/", {"pool": "h100"}).content.decode()
    assert "Updated" in html and 'role="status">Updated' not in html


def test_the_heatmap_says_when_it_was_updated_in_the_sites_format(world, web):
    """"Updated 19:00:05 JST" gave no day: a tab left open overnight whose refresh had stopped could not tell
    yesterday's figures from today's. It is written as every time on the site, with its day and seconds."""
    from zoneinfo import ZoneInfo

    from django.utils import timezone

    client = web("alpha-viewer")
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    before = timezone.now().astimezone(ZoneInfo("Asia/Tokyo"))
    html = client.get("/availability/grid/", {"pool": "h100"}).content.decode()
    after = timezone.now().astimezone(ZoneInfo("Asia/Tokyo"))
    (updated,) = re.findall(r"Updated ([^<]*)</p>", html)
    # The day of the request's start or end (a request straddling midnight in Tokyo may write either).
    assert any(re.fullmatch(rf"{t:%a} {t.day} {t:%b} \d\d:\d\d:\d\d JST", updated) for t in (before, after)), updated


def test_the_calendar_side_panel_is_not_a_live_region(world, web):
    """Focus moves to the panel's heading after each swap; a live region would also read the whole form out."""
    html = web("alpha-lead").get("/calendar/").content.decode()
    (panel,) = re.findall(r'<aside id="side-panel"[^>]*>', html)
    assert "aria-live" not in panel and 'aria-label="Booking and reservation details"' in panel


def test_audit_changes_give_times_in_the_readers_zone(world, web, book):
    """The audit page's When column was in the reader's zone, but the instants inside "before → after"
    (a booking's start and end, a changed end) were the stored UTC text: "end: 2026-12-20T12:00:00Z"."""
    from datetime import UTC, datetime

    day = (datetime.now(UTC) + timedelta(days=3)).date()
    start = datetime(day.year, day.month, day.day, 10, tzinfo=UTC)
    reservation = book("alpha-lead", start, hours=2)
    services.reservation_update(actor=world.users["alpha-lead"], reservation=reservation,
                                end=start + timedelta(hours=3))
    client = web("alpha-lead")
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    html = client.get("/audit/", {"action": "reservation."}).content.decode()
    assert "T10:00:00Z" not in html and "T12:00:00Z" not in html and "T13:00:00Z" not in html
    assert f"{day:%Y-%m-%d} 19:00 JST" in html  # the start, 10:00 UTC
    assert f"End: {day:%Y-%m-%d} 21:00 JST → {day:%Y-%m-%d} 22:00 JST" in html


def test_audit_views_say_what_happened_in_words_not_action_codes(world, web, book, t0):
    """The audit page, the dashboard's recent activity and a reservation's status timeline showed the stored
    action codes ("reservation.create", "quota.update", "create") where a lead reads what happened."""
    from tenants.services import quota_update

    reservation = book("alpha-lead", t0, hours=2)
    services.reservation_update(actor=world.users["alpha-lead"], reservation=reservation,
                                end=t0 + timedelta(hours=3))
    quota = world.tenants["alpha"].quotas.get(pool=world.pool)
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=quota.max_nodes + 1)
    client = web("alpha-lead")

    def text(html: str) -> str:
        return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))

    audit = client.get("/audit/").content.decode()
    body = text(audit[audit.index("<tbody>"):audit.index("</tbody>")])
    assert "reservation.create" not in body and "reservation.update" not in body and "quota.update" not in body
    assert "Booked" in body and "Changed" in body and "Quota changed" in body
    # The codes stay in the markup (the Action filter takes their prefixes), just not as the words shown.
    assert 'data-action="reservation.create"' in audit

    dashboard = client.get("/").content.decode()
    activity = text(dashboard[dashboard.index('id="activity-title"'):])
    activity = activity[:activity.index("Nothing yet") if "Nothing yet" in activity else len(activity)]
    assert "reservation.create" not in activity and "reservation.update" not in activity, activity[:500]
    assert f"Booked #{reservation.pk}" in activity

    detail = client.get(f"/reservations/{reservation.pk}/").content.decode()
    timeline = detail[detail.index('id="timeline-title"'):]
    timeline = text(timeline[:timeline.index("</section>")])
    assert "— create" not in timeline and "— update" not in timeline, timeline
    assert "— Booked by alpha-lead" in timeline and "— Changed by alpha-lead" in timeline


def test_the_audit_page_names_objects_in_words_and_links_reservations(world, web, book, t0):
    """The Object column read "reservations.reservation #12" (the model's label) and led nowhere."""
    reservation = book("alpha-lead", t0, hours=2)
    html = web("alpha-lead").get("/audit/").content.decode()
    body = html[html.index("<tbody>"):html.index("</tbody>")]
    assert "reservations.reservation" not in body
    assert f'<a href="/reservations/{reservation.pk}/">Reservation #{reservation.pk}</a>' in body


def test_an_audit_filter_that_matches_nothing_says_so_and_offers_the_way_back(world, web, book, t0):
    """With an Action filter that matched no row the page said "Nothing recorded yet." though the tenant's log
    was full: the lead took the log for empty rather than the filter for wrong."""
    book("alpha-lead", t0, hours=2)
    html = web("alpha-lead").get("/audit/", {"action": "quota"}).content.decode()
    assert "Nothing recorded yet" not in html
    assert "No entries match" in html and 'href="/audit/"' in html
    assert "Nothing recorded yet" in web("beta-lead").get("/audit/").content.decode()  # truly empty: as before


def test_the_audit_pages_before_and_after_names_fields_in_words(world, web, book, t0):
    """The audit page's "Before → after" column gave the stored field names: "node_count: 1",
    "max_nodes: 3 → 5". A lead reads them in words, as the Action column's codes are."""
    from tenants.services import quota_update

    book("alpha-lead", t0, hours=2, nodes=1)
    quota = world.tenants["alpha"].quotas.get(pool=world.pool)
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    audit = web("alpha-lead").get("/audit/").content.decode()
    body = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", audit[audit.index("<tbody>"):audit.index("</tbody>")]))
    for raw in ("node_count", "max_nodes", "billing:", "status:", "start:", "end:"):
        assert raw not in body, (raw, body)
    assert "Max nodes: 3 → 5" in body
    assert "Nodes: 1" in body and "Status: Confirmed" in body and "Billing: Committed" in body


def test_the_audit_pages_before_and_after_gives_lists_flags_and_kinds_in_words(world, web):
    """The audit page showed stored values: 'Events: ["reservation.confirmed", …]', 'Enabled: true',
    'Kind: Ssh key'. Lists read as comma-separated words, flags as yes/no, kinds in plain words."""
    from django.db import transaction

    from notifications.services import slack_subscriptions_update
    from portal.core.services import audit_record

    tenant = world.tenants["alpha"]
    lead = world.users["alpha-lead"]
    slack_subscriptions_update(actor=lead, tenant=tenant, events=["reservation.confirmed", "cluster.ready"])
    slack_subscriptions_update(actor=lead, tenant=tenant, enabled=False)
    with transaction.atomic():
        audit_record(actor=lead, action="cluster.credential_download", obj=tenant, tenant_id=tenant.pk,
                     after={"kind": "ssh_key", "fingerprint": "SHA256:abc"})
    audit = web("alpha-lead").get("/audit/").content.decode()
    body = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", audit[audit.index("<tbody>"):audit.index("</tbody>")]))
    for raw in ("[", "&quot;", '"', "reservation.confirmed", "true", "false", "Ssh key"):
        assert raw not in body, (raw, body)
    assert "Events: Reservation confirmed, Reservation changed," in body, body
    assert "→ Reservation confirmed, Cluster ready" in body, body
    assert "Enabled: yes → no" in body, body
    assert "Kind: SSH key;" in body, body


def test_every_time_on_the_reservation_fleet_and_account_pages_names_its_zone(world, web, book, t0):
    """A window read "Thu 3 Dec 19:00 – Thu 3 Dec 21:00 JST" (the start with no zone, and across a DST change
    not in the end's), and the dashboard's activity, a changed end's old value and the account page's token
    times ("3 Dec 2026 19:00") gave no zone at all."""
    from zoneinfo import ZoneInfo

    from tenants.services import token_issue
    from tests.zoned import unzoned_times

    reservation = book("alpha-lead", t0, hours=2, name="zoned")
    services.reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=t0 + timedelta(hours=3))
    token_issue(user=world.users["alpha-lead"])
    start = t0.astimezone(ZoneInfo("Asia/Tokyo"))
    page = f"/reservations/{reservation.pk}/"
    for who, paths in (("alpha-lead", ["/", "/reservations/", page, page + "panel/", page + "cancel/", "/account/"]),
                       ("staff", ["/fleet/"])):
        client = web(who)
        session = client.session
        session["portal_tz"] = "Asia/Tokyo"
        session.save()
        for path in paths:
            response = client.get(path)
            assert response.status_code == 200, path
            html = response.content.decode()
            assert re.search(r"\d\d:\d\d JST", html), path
            # The fleet timeline's axis ticks ("06:00") are in the zone its heading's window names.
            html = re.sub(r'<span class="tick"[^>]*>[^<]*</span>', "", html)
            assert not unzoned_times(html), (path, unzoned_times(html))
            if path in ("/", "/reservations/", page + "panel/", page + "cancel/"):  # the window as a range
                assert re.search(rf"{start:%H:%M} JST(</time>)? –", html), path


def test_the_reservation_and_account_pages_write_times_in_the_sites_one_format(world, web, book, t0):
    """The booking page wrote its window "Thursday 3 December 2026, 19:00 JST", its booking time "3 Dec 2026
    19:00 JST" and its timeline "3 Dec 19:00 JST", and the account page its tokens' times "3 Dec 2026 19:00
    JST", where every other page writes "Thu 3 Dec 19:00 JST". A booking, the list's rows and a token can be of
    another year: those keep it, in the shared filter's year variant ("Thu 3 Dec 2026 19:00 JST")."""
    from zoneinfo import ZoneInfo

    from reservations.models import Reservation
    from tenants.services import token_issue

    tokyo = ZoneInfo("Asia/Tokyo")

    def when(value, year=False):
        local = value.astimezone(tokyo)
        return f"{local:%a} {local.day} {local:%b}{f' {local.year}' if year else ''} {local:%H:%M} JST"

    reservation = book("alpha-lead", t0, hours=2, name="formats")
    services.reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=t0 + timedelta(hours=3))
    reservation = Reservation.objects.get(pk=reservation.pk)
    token, _ = token_issue(user=world.users["alpha-lead"], expires_in_days=400)
    client = web("alpha-lead")
    session = client.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()

    detail = client.get(f"/reservations/{reservation.pk}/").content.decode()
    assert f">{when(reservation.start, year=True)}</time>" in detail, detail
    assert f">{when(reservation.end, year=True)}</time>" in detail, detail
    assert f" on {when(reservation.created_at, year=True)}</dd>" in detail, detail
    timeline = detail[detail.index('id="timeline-title"'):]
    stamps = re.findall(r"<time [^>]*>([^<]*)</time>", timeline)
    assert stamps and all(re.fullmatch(r"[A-Z][a-z]{2} \d{1,2} [A-Z][a-z]{2} \d\d:\d\d JST", s) for s in stamps), stamps

    listing = client.get("/reservations/").content.decode()
    assert f">{when(reservation.start, year=True)}</time> – " in listing, listing
    assert f">{when(reservation.end)}</time></td>" in listing, listing

    account = client.get("/account/").content.decode()
    assert f">{when(token.created_at, year=True)}</td>" in account, account
    assert f">{when(token.expires_at, year=True)}</td>" in account, account


@pytest.mark.parametrize("query", [{"pool": "h100"}, {"page": "1"}, {"start": "2030-01-07"}])
def test_fleet_filter_shows_the_span_it_draws_when_the_query_leaves_it_out(world, web, query):
    """A fleet link naming only the pool (or a page, or a start) drew the default 3 days while the Span box
    showed "1 day", its first option: the filter said one thing and the timeline another."""
    html = web("staff").get("/fleet/", query).content.decode()
    selected = re.findall(r'<option value="(\d+)"[^>]*selected', _select(html, "days"))
    assert selected == ["3"], selected


def test_dashboard_activity_says_which_cluster_a_row_is_about(world, web, book, t0):
    """Every booking adds a "Cluster requested" row; the dashboard's recent activity listed ten of them, each
    "Sun 6 Dec 16:55 CET — Cluster requested by the system", with nothing to tell one from another."""
    from provisioning.services import cluster_create_for_reservation

    reservation = book("alpha-lead", t0, hours=2)
    cluster = cluster_create_for_reservation(reservation_id=reservation.pk)
    dashboard = web("alpha-lead").get("/").content.decode()
    activity = dashboard[dashboard.index('id="activity-title"'):dashboard.index('id="upcoming-title"')]
    assert re.search(rf'Cluster requested\s*<a href="/clusters/{cluster.pk}/">#{cluster.pk}</a>', activity), activity
    assert f'<a href="/reservations/{reservation.pk}/">#{reservation.pk}</a>' in activity  # as before


def test_cluster_health_names_the_level_of_each_nodes_latest_check_in_full(world, web, book, t0):
    """Beside each node the cluster's health page wrote the level cut to one word with an ellipsis,
    "Medium … · 2026-12-06 16:58 CET", as if something had been left out."""
    from django.utils import timezone

    from provisioning.health.models import HealthCheck
    from provisioning.services import cluster_create_for_reservation

    reservation = book("alpha-lead", t0, hours=2)
    cluster = cluster_create_for_reservation(reservation_id=reservation.pk)
    node = reservation.allocations.get().node
    HealthCheck.objects.create(node=node, reservation=reservation, level="medium", trigger="acceptance",
                               status="done", verdict="pass", summary="all checks passed",
                               finished_at=timezone.now())
    html = web("alpha-lead").get(f"/health/clusters/{cluster.pk}/").content.decode()
    heading = re.search(rf'data-node="{node.hostname}">\s*<h3>(.*?)</h3>', html, re.S).group(1)
    assert "…" not in heading and "medium check" in heading, heading


def test_fleet_health_lists_nodes_never_checked_among_those_that_need_a_look(world, web):
    """On a fresh fleet the health page counted 62 nodes "not checked" and then listed none under "Nodes that
    need a look", saying "Nothing here — every node in service passes": a node without a verdict fell out of
    the default list (its NULL verdict made the exclusion's condition unknown)."""
    from django.utils import timezone

    from provisioning.health.models import HealthCheck

    checked = world.nodes[0]
    HealthCheck.objects.create(node=checked, level="quick", trigger="schedule", status="done", verdict="pass",
                               summary="all checks passed", finished_at=timezone.now())
    html = web("staff").get("/health/").content.decode()
    assert "every node in service passes" not in html
    listed = set(re.findall(r'<tr data-node="([^"]+)"', html))
    assert listed == {n.hostname for n in world.nodes[1:]}, listed
