"""Health on the pages: the staff board, repair steps, the cluster page's button, the badge and results tags."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.template import Context, Template
from django.test import Client, RequestFactory

from provisioning.health.models import HealthCheck, Repair
from provisioning.health.selectors import nodes_with_health
from provisioning.health.services import health_checks_request
from reservations.models import Node

from .conftest import fleet_spec
from .test_api import make_cluster

ECC = [{"kind": "ecc_uncorrected", "gpu": 3}]


def browser(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture
def checked(fleet, settings, eager, now_slot, django_capture_on_commit_callbacks):
    """The fleet after one sweep: gpu-002 fails (drained, repair open), the rest pass."""
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-002": ECC})
    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], now_slot, now_slot + timedelta(hours=4))
    with django_capture_on_commit_callbacks(execute=True):
        health_checks_request(nodes=fleet.nodes, level="quick", trigger="schedule")
    return make_cluster(booking)


@pytest.mark.django_db
def test_staff_board_shows_what_needs_a_look(fleet, checked):
    page = browser(fleet.users["staff"]).get("/health/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "gpu-002" in html and "ecc_uncorrected_volatile" in html and "Open repairs" in html
    assert 'data-node="gpu-001"' not in html  # passing and available: not listed by default
    assert 'data-node="gpu-001"' in browser(fleet.users["staff"]).get("/health/?verdict=all").content.decode()
    assert browser(fleet.users["alpha-lead"]).get("/health/").status_code == 403
    assert browser(None).get("/health/").status_code == 302
    node_page = browser(fleet.users["staff"]).get("/health/nodes/gpu-002/")
    assert node_page.status_code == 200 and b"drain_and_reset" in node_page.content


@pytest.mark.django_db
def test_staff_take_a_repair_through_the_page(fleet, checked, django_capture_on_commit_callbacks):
    repair = Repair.objects.get()
    client = browser(fleet.users["staff"])
    page = client.get(f"/health/repairs/{repair.pk}/")
    assert page.status_code == 200 and b"Accept repair" in page.content
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/health/repairs/{repair.pk}/step/", {"to": "accepted", "note": "on it"})
    assert response.status_code == 302
    repair.refresh_from_db()
    assert repair.state == "accepted" and repair.steps[-1]["note"] == "on it"
    client.post(f"/health/repairs/{repair.pk}/step/", {"to": "rejoined"})  # refused: shown as a message
    repair.refresh_from_db()
    assert repair.state == "accepted"
    assert browser(fleet.users["alpha-lead"]).post(
        f"/health/repairs/{repair.pk}/step/", {"to": "cordoned"}).status_code == 403


@pytest.mark.django_db
def test_cluster_page_button_for_leads_and_members_only(fleet, checked, settings, eager,
                                                        django_capture_on_commit_callbacks):
    url = f"/health/clusters/{checked.pk}/"
    lead_page = browser(fleet.users["alpha-lead"]).get(url)
    assert lead_page.status_code == 200
    html = lead_page.content.decode()
    assert "Check my nodes" in html and "gpu-001" in html
    # The failed node was swapped out; the page shows the nodes the cluster holds now.
    viewer_page = browser(fleet.users["alpha-viewer"]).get(url).content.decode()
    assert "Check my nodes" not in viewer_page
    assert browser(fleet.users["beta-lead"]).get(url).status_code == 404
    before = HealthCheck.objects.count()
    assert browser(fleet.users["alpha-viewer"]).post(url + "run/", {"level": "quick"}).status_code == 403
    assert browser(fleet.users["beta-lead"]).post(url + "run/", {"level": "quick"}).status_code == 404
    assert HealthCheck.objects.count() == before
    with django_capture_on_commit_callbacks(execute=True):
        response = browser(fleet.users["alpha-member"]).post(url + "run/", {"level": "medium"})
    assert response.status_code == 302
    new = HealthCheck.objects.filter(trigger="tenant")
    assert new.count() == 2 and {c.level for c in new} == {"medium"}
    partial = browser(fleet.users["alpha-member"]).get(url + "results/", HTTP_HX_REQUEST="true")
    assert partial.status_code == 200 and b"GPU health" in partial.content


@pytest.mark.django_db
def test_badge_and_results_tags(fleet, checked):
    annotated = {n.hostname: n for n in nodes_with_health(Node.objects.all())}
    tpl = Template("{% load health %}{% health_badge node %}")
    assert 'data-verdict="fail"' in tpl.render(Context({"node": annotated["gpu-002"]}))
    assert 'data-verdict="pass"' in tpl.render(Context({"node": annotated["gpu-003"]}))
    gpu_003_check = HealthCheck.objects.get(node__hostname="gpu-003")
    assert 'data-verdict="pass"' in tpl.render(Context({"node": gpu_003_check}))
    assert "not checked" in tpl.render(Context({"node": None}))
    request = RequestFactory().get("/")
    request.user = fleet.users["alpha-viewer"]
    html = Template("{% load health %}{% cluster_health cluster %}").render(
        Context({"cluster": checked, "request": request}))
    assert "GPU health" in html and "gpu-001" in html and f"/health/clusters/{checked.pk}/" in html
    request.user = fleet.users["beta-lead"]  # another tenant sees no results of alpha's nodes
    html = Template("{% load health %}{% cluster_health cluster %}").render(
        Context({"cluster": checked, "request": request}))
    assert "gpu-001" not in html and 'data-verdict="pass"' not in html


@pytest.mark.django_db
def test_badge_refuses_a_plain_node(fleet, checked, django_assert_num_queries):
    """A plain node carries no say over whose checks may be shown: the tag would read its newest check
    for anyone, another tenant's included. The caller passes what the reader may see (an annotated node
    from a staff-only selector, or a check it scoped itself); a plain node is an error, and nothing is read."""
    tpl = Template("{% load health %}{% health_badge node %}")
    node = Node.objects.get(hostname="gpu-002")
    with django_assert_num_queries(0), pytest.raises(TypeError, match="health_badge"):
        tpl.render(Context({"node": node}))
    # The staff node page passes an annotated node, and still shows its badge.
    page = browser(fleet.users["staff"]).get("/health/nodes/gpu-002/").content.decode()
    heading = page.split("<h1>", 1)[1].split("</h1>", 1)[0]
    assert heading.startswith("gpu-002 ") and 'data-verdict="fail"' in heading


@pytest.mark.django_db
def test_check_detail_page_is_scoped(fleet, checked):
    check = HealthCheck.objects.get(node__hostname="gpu-002")
    assert browser(fleet.users["alpha-viewer"]).get(f"/health/checks/{check.pk}/").status_code == 200
    assert browser(fleet.users["beta-viewer"]).get(f"/health/checks/{check.pk}/").status_code == 404
    page = browser(fleet.users["staff"]).get(f"/health/checks/{check.pk}/").content.decode()
    assert "ecc_uncorrected_volatile" in page and "drain_and_reset" in page


@pytest.mark.django_db
@pytest.mark.parametrize("when, status", [("future", "confirmed"), ("past", "completed"), ("now", "cancelled")])
def test_the_check_button_is_offered_only_while_the_booking_holds_its_nodes(fleet, now_slot, when, status):
    """The service refuses a check of a cluster whose booking does not hold its nodes now (not started yet,
    over, cancelled); the page offered the button anyway, and pressing it only earned a refusal."""
    start = {"future": now_slot + timedelta(days=1), "past": now_slot - timedelta(days=1), "now": now_slot}[when]
    cluster = make_cluster(fleet.book("alpha", ["gpu-001"], start, start + timedelta(hours=2), status=status))
    request = RequestFactory().get("/")
    for who in ("alpha-lead", "alpha-member", "staff"):
        page = browser(fleet.users[who]).get(f"/health/clusters/{cluster.pk}/")
        assert page.status_code == 200
        assert "Check my nodes" not in page.content.decode(), who
        request.user = fleet.users[who]
        compact = Template("{% load health %}{% cluster_health cluster %}").render(
            Context({"cluster": cluster, "request": request}))
        assert "checks on demand" not in compact, who
    # A post anyway (a stale page) is refused with the reason, not as a matter of role; nothing is queued.
    refused = browser(fleet.users["alpha-lead"]).post(f"/health/clusters/{cluster.pk}/run/", {"level": "quick"},
                                                      follow=True)
    assert refused.status_code == 200 and "does not hold its nodes now" in refused.content.decode()
    assert not HealthCheck.objects.exists()
    # Still offered, and accepted, while it holds them.
    live = make_cluster(fleet.book("alpha", ["gpu-002"], now_slot, now_slot + timedelta(hours=2)))
    assert "Check my nodes" in browser(fleet.users["alpha-lead"]).get(f"/health/clusters/{live.pk}/").content.decode()


@pytest.mark.django_db
def test_health_pages_say_which_zone_their_times_are_in(fleet, checked):
    """The health pages render times in the reader's zone (every portal page does), but their labels said
    "(UTC)": a lead in Tokyo read "Times (UTC) queued … 18:30" for a check queued at 09:30 UTC."""
    import re
    from zoneinfo import ZoneInfo

    check = HealthCheck.objects.get(node__hostname="gpu-002")
    tokyo = check.created_at.astimezone(ZoneInfo("Asia/Tokyo"))
    for who, path in (("alpha-viewer", f"/health/checks/{check.pk}/"),
                      ("alpha-viewer", f"/health/clusters/{checked.pk}/"),
                      ("staff", "/health/?verdict=all"), ("staff", "/health/nodes/gpu-002/")):
        client = browser(fleet.users[who])
        session = client.session
        session["portal_tz"] = "Asia/Tokyo"
        session.save()
        html = client.get(path).content.decode()
        assert not re.search(r"\(UTC\)|\d\d:\d\d(:\d\d)? UTC\b", html), (path, re.findall(r".{0,120}UTC.{0,20}", html))
        assert "JST" in html, path
        # The site's one format ("Thu 3 Dec 18:30 JST"), not "2026-12-03 18:30 JST" on these pages alone.
        text = re.sub(r"<[^>]*>", " ", html)
        assert not re.search(r"\d{4}-\d\d-\d\d", text), (path, re.findall(r".{0,60}\d{4}-\d\d-\d\d.{0,20}", text))
    page = browser(fleet.users["alpha-viewer"])
    session = page.session
    session["portal_tz"] = "Asia/Tokyo"
    session.save()
    assert f"{tokyo:%a %-d %b %H:%M:%S} JST" in page.get(f"/health/checks/{check.pk}/").content.decode()


@pytest.mark.django_db
def test_the_check_and_cluster_pages_show_a_tenant_no_process_of_an_older_agents_report(fleet, now_slot):
    """A check stored from an agent that named stray processes in its messages (pids, an XID line's process):
    the team's check page, cluster page and results tag count them; staff's check page names them."""
    from .test_api import OLD_SECRETS, old_check

    alpha = fleet.book("alpha", ["gpu-003"], now_slot, now_slot + timedelta(hours=3))
    cluster = make_cluster(alpha)
    check = old_check(fleet.node("gpu-003"), alpha)
    viewer = browser(fleet.users["alpha-viewer"])
    for path in (f"/health/checks/{check.pk}/", f"/health/clusters/{cluster.pk}/",
                 f"/health/clusters/{cluster.pk}/results/"):
        response = viewer.get(path)
        assert response.status_code == 200, path
        page = response.content.decode()
        assert "2 stray compute processes" in page, path
        assert not [s for s in OLD_SECRETS if s in page], (path, [s for s in OLD_SECRETS if s in page])
    request = RequestFactory().get("/")
    request.user = fleet.users["alpha-viewer"]
    tag = Template("{% load health %}{% cluster_health cluster %}").render(
        Context({"request": request, "cluster": cluster}))
    assert "2 stray compute processes" in tag and not [s for s in OLD_SECRETS if s in tag]
    staff = browser(fleet.users["staff"]).get(f"/health/checks/{check.pk}/").content.decode()
    assert "4242" in staff and "secret_train" in staff


@pytest.mark.django_db
def test_every_time_on_the_node_page_and_the_results_names_its_zone(fleet, checked):
    """The node page's repair list and the cluster's GPU results showed "Y-m-d H:i" with no zone, next to
    times that name it: a lead in Tokyo could not tell the finished time of a check was in JST."""
    import re

    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d(?::\d\d)?(?![:\d])(?! [A-Z]{2,5}\b| [+-]\d\d)")
    for who, path in (("staff", "/health/nodes/gpu-002/"), ("alpha-viewer", f"/health/clusters/{checked.pk}/"),
                      ("alpha-viewer", f"/health/clusters/{checked.pk}/results/")):
        client = browser(fleet.users[who])
        session = client.session
        session["portal_tz"] = "Asia/Tokyo"
        session.save()
        html = client.get(path).content.decode()
        assert re.search(r"\w{3} \d{1,2} \w{3} \d\d:\d\d", html), path  # a time is shown (the site's format)
        assert not stamp.search(html), (path, [html[m.start() - 60:m.end() + 10] for m in stamp.finditer(html)])


@pytest.mark.django_db
def test_the_queued_checks_message_counts_one_node_in_the_singular(fleet, now_slot):
    """The sweep and the cluster's run button said "Quick checks queued on 1 nodes." and "1 quick checks
    queued." when one node was checked."""

    def said(response) -> list[str]:  # the messages shown on the page the post redirected to
        assert response.status_code == 200 and response.redirect_chain
        return [str(m) for m in response.context["messages"]]

    Node.objects.exclude(hostname="gpu-001").update(state="retired")
    staff = browser(fleet.users["staff"])
    assert said(staff.post("/health/sweep/", follow=True)) == ["Quick check queued on 1 node."]
    Node.objects.filter(hostname="gpu-002").update(state="available")
    HealthCheck.objects.all().delete()
    assert said(staff.post("/health/sweep/", follow=True)) == ["Quick checks queued on 2 nodes."]

    Node.objects.update(state="available")
    HealthCheck.objects.all().delete()
    cluster = make_cluster(fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=2)))
    run = f"/health/clusters/{cluster.pk}/run/"
    assert said(browser(fleet.users["alpha-lead"]).post(run, {"level": "quick"}, follow=True)) == [
        "1 quick check queued."]
    two = make_cluster(fleet.book("beta", ["gpu-003", "gpu-004"], now_slot, now_slot + timedelta(hours=2)))
    run = f"/health/clusters/{two.pk}/run/"
    assert said(browser(fleet.users["beta-lead"]).post(run, {"level": "medium"}, follow=True)) == [
        "2 medium checks queued."]


@pytest.mark.django_db
def test_the_check_page_names_the_zone_of_its_started_and_finished_times(fleet, checked):
    """The check page said "queued 2026-12-03 01:30:00 JST · started 01:30:01 · finished 01:30:04": only the
    first of its three times named its zone."""
    from zoneinfo import ZoneInfo

    from tests.zoned import unzoned_times

    check = HealthCheck.objects.get(node__hostname="gpu-002")
    assert check.started_at and check.finished_at
    tokyo = ZoneInfo("Asia/Tokyo")
    for who in ("alpha-viewer", "staff"):
        client = browser(fleet.users[who])
        session = client.session
        session["portal_tz"] = "Asia/Tokyo"
        session.save()
        html = client.get(f"/health/checks/{check.pk}/").content.decode()
        assert f"started {check.started_at.astimezone(tokyo):%H:%M:%S} JST" in html, who
        assert f"finished {check.finished_at.astimezone(tokyo):%H:%M:%S} JST" in html, who
        assert not unzoned_times(html), (who, unzoned_times(html))


@pytest.mark.django_db
def test_a_checks_times_show_the_date_when_it_changed_since_it_was_queued(fleet, checked):
    """The check page showed "queued 2026-03-01 23:59:30 JST · started 00:00:10 JST · finished 00:04:00 JST": a
    check that ran past midnight (in the reader's zone) read as if it had started before it was queued. The
    started and finished times carry their date when it is not the queued time's date there."""
    import re
    from datetime import UTC, datetime

    check = HealthCheck.objects.get(node__hostname="gpu-002")
    queued = datetime(2026, 3, 1, 14, 59, 30, tzinfo=UTC)  # 23:59:30 in Tokyo, 14:59:30 in UTC
    HealthCheck.objects.filter(pk=check.pk).update(created_at=queued, started_at=queued + timedelta(seconds=40),
                                                   finished_at=queued + timedelta(minutes=4, seconds=30))

    def times(zone: str) -> str:
        client = browser(fleet.users["staff"])  # a tenant sees a check run in its booking; this one is not now
        session = client.session
        session["portal_tz"] = zone
        session.save()
        html = client.get(f"/health/checks/{check.pk}/").content.decode()
        found = re.search(r"<dt>Times</dt><dd>(.*?)</dd>", html, re.S)
        assert found, html
        return found.group(1)

    assert times("Asia/Tokyo") == ("queued Sun 1 Mar 23:59:30 JST · started Mon 2 Mar 00:00:10 JST"
                                   " · finished Mon 2 Mar 00:04:00 JST")
    # The same day: the times alone, as before.
    assert times("UTC") == "queued Sun 1 Mar 14:59:30 UTC · started 15:00:10 UTC · finished 15:04:00 UTC"


@pytest.mark.django_db
def test_the_node_pages_find_a_node_named_in_another_case(fleet, django_capture_on_commit_callbacks):
    # Hostnames are one host ignoring case (node_create refuses a case variant): a path naming GPU-001 (as
    # an agent's or a DNS name reads) is node gpu-001's page and buttons, not a 404.
    client = browser(fleet.users["staff"])
    page = client.get("/health/nodes/GPU-001/")
    assert page.status_code == 200 and page.context["node"] == fleet.node("gpu-001")
    with django_capture_on_commit_callbacks():
        checked = client.post("/health/nodes/Gpu-001/check/", {"level": "quick"})
    assert checked.status_code == 302 and checked["Location"] == "/health/nodes/gpu-001/"
    assert HealthCheck.objects.filter(node=fleet.node("gpu-001"), level="quick").exists()
    with django_capture_on_commit_callbacks():
        opened = client.post("/health/nodes/GPU-002/repair/", {"reason": "XID 79"})
    assert opened.status_code == 302
    assert Repair.objects.filter(node=fleet.node("gpu-002")).exists()
