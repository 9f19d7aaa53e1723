"""The calendar's side panel follows the booking it shows while it is open: its status, its nodes' states and its
cluster change in the panel (and the event's status on the calendar) without a reload, and what the user is doing in
the panel (a name being typed, focus on the cluster's link) is left as it was."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from reservations import services

from .conftest import at, open_day

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def open_polling_panel(world, live_server, new_page, sign_in, day, monkeypatch, name: str):
    """alpha-lead's booking called name, opened in the calendar's side panel, whose live part polls every second
    (3 s as shipped): (the page, the reservation)."""
    from reservations import views

    monkeypatch.setattr(views, "PANEL_POLL_SECONDS", 1)
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=1, start=at(day, 10), end=at(day, 12), name=name)
    page = sign_in(new_page(), "alpha-lead")
    open_day(page, live_server, day)
    page.locator(f".fc-event[data-reservation-id='{r.pk}']").click()
    expect(page.locator(f"#side-panel #panel-live-{r.pk}")).to_have_attribute("hx-trigger", "every 1s")
    return page, r


def test_the_calendars_panel_follows_its_booking_without_a_reload(world, live_server, new_page, sign_in, day,
                                                                  monkeypatch):
    """A lead who opened a booking in the calendar's side panel saw its hostnames only, and the same status, nodes
    and no cluster until a reload: the panel never polled. It now polls (every 3 s; 1 s here) and shows each change,
    and stops once the booking is over."""
    from provisioning.models import VirtualCluster
    from provisioning.services import cluster_create_for_reservation
    from reservations import views
    from reservations.models import Reservation

    monkeypatch.setattr(views, "PANEL_POLL_SECONDS", 1)
    monkeypatch.setattr(views, "ACTIVE_POLL_SECONDS", 1)
    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=1, start=at(day, 10), end=at(day, 12), name="live run")
    VirtualCluster.objects.filter(reservation=r).delete()  # not created yet (here the commit created it at once)
    (node,) = [a.node for a in r.allocations.filter(active=True).select_related("node")]

    page = sign_in(new_page(), "alpha-lead")
    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    open_day(page, live_server, day)
    event = page.locator(f".fc-event[data-reservation-id='{r.pk}']")
    expect(event.locator(".ev-status")).to_have_text("Confirmed")
    event.click()
    panel = page.locator("#side-panel")
    expect(panel.locator("h2")).to_contain_text("live run")
    live = panel.locator(f"#panel-live-{r.pk}")
    expect(live.locator(".badge").first).to_have_text("Confirmed")
    expect(live).to_have_attribute("hx-trigger", "every 1s")
    expect(live.locator("li")).to_have_text([node.hostname])
    expect(live.locator(f"#cluster-badge-{r.pk}")).to_have_count(0)
    name = panel.get_by_label("Name", exact=True)
    name.fill("half-typed new na")  # a rename being typed while the booking moves on

    # the booking is being provisioned, its node drained, its cluster row appears
    Reservation.objects.filter(pk=r.pk).update(status="provisioning")
    services.node_update(actor=world.users["staff"], node=node, state="draining", reason="health check failed")
    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    expect(live.locator(".badge").first).to_have_text("Provisioning", timeout=10_000)
    expect(live.locator("li")).to_have_text([f"{node.hostname} Draining"], timeout=10_000)
    badge = live.locator(f"#cluster-badge-{r.pk}")
    expect(badge).to_have_text("Pending", timeout=10_000)
    expect(event.locator(".ev-status")).to_have_text("Provisioning", timeout=10_000)  # the calendar refetched
    # what was being typed is still there, and still has focus
    expect(name).to_have_value("half-typed new na")
    expect(name).to_be_focused()

    # focus on the cluster's link survives the part being replaced under it
    badge.focus()
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="installing_drivers")
    expect(badge).to_have_text("Installing drivers", timeout=10_000)
    expect(badge).to_be_focused()

    # over: the panel says so, no longer offers a change, and stops polling
    Reservation.objects.filter(pk=r.pk).update(status="completed")
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="deleted")
    expect(live.locator(".badge").first).to_have_text("Completed", timeout=10_000)
    assert live.get_attribute("hx-trigger") is None and live.get_attribute("hx-get") is None
    expect(panel.locator("[data-cancel]")).to_have_count(0)
    expect(panel.get_by_label("Name", exact=True)).to_have_count(0)
    requests: list[str] = []
    page.on("request", lambda req: requests.append(req.url) if "/panel/" in req.url else None)
    page.wait_for_timeout(2500)
    assert requests == []
    expect(panel.locator("h2")).to_contain_text("live run")
    assert page.errors == []
    assert console_errors == []


def test_a_bookings_page_shows_its_cluster_once_the_row_exists_without_a_reload(world, live_server, new_page, sign_in,
                                                                              day):
    """A booking's page opened before its cluster row existed (a worker creates it just after the booking commits)
    showed the placeholder until a reload: it never polled. It now polls until the row exists; then the cluster's
    card comes, and its own poll follows the cluster from there (the placeholder's poll is gone)."""
    from provisioning.models import VirtualCluster
    from provisioning.services import cluster_create_for_reservation

    r = services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                    node_count=1, start=at(day, 10), end=at(day, 12), name="page run")
    # Here the booking's commit runs its subscribers at once: its cluster row is taken away again, as it is
    # until the worker has run.
    VirtualCluster.objects.filter(reservation=r).delete()
    page = sign_in(new_page(), "alpha-lead")
    page.goto(f"{live_server.url}/reservations/{r.pk}/")
    expect(page.locator("[data-placeholder='cluster-phases']")).to_be_visible()

    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    status = page.locator("#cluster-status")
    expect(status).to_contain_text("Pending", timeout=10_000)
    expect(page.locator("[data-placeholder]")).to_have_count(0)
    expect(page.get_by_role("heading", name=f"Virtual cluster #{cluster.pk}")).to_be_visible()
    waits: list[str] = []
    page.on("request", lambda req: waits.append(req.url) if "cluster=none" in req.url else None)
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="installing_drivers")
    expect(status).to_contain_text("Installing drivers", timeout=10_000)
    assert waits == []
    assert page.errors == []


def test_a_poll_answer_that_lands_after_a_cancel_does_not_bring_back_the_old_actions(world, live_server, new_page,
                                                                                     sign_in, day, monkeypatch):
    """A poll the panel sent before its booking was cancelled, answered after the cancel's panel came: its
    out-of-band actions (by the reservation's id) found the new panel's and put the old ones back (the Cancel link
    and the rename form of a cancelled booking). An answer now replaces only the actions it knew the panel showed."""
    from reservations.models import Reservation

    page, r = open_polling_panel(world, live_server, new_page, sign_in, day, monkeypatch, "racing run")
    panel = page.locator("#side-panel")

    # The next poll is answered while the booking (renamed elsewhere) still offers its changes; the answer is held
    # back, as a slow network would, until the cancel's panel has come.
    held: list = []

    def hold(route):
        if held:
            route.continue_()  # the polls after it (none until it is answered: htmx waits for it)
        else:
            held.append((route, route.fetch()))

    page.route("**/panel/?live=*", hold)
    Reservation.objects.filter(pk=r.pk).update(name="renamed elsewhere")
    for _ in range(50):  # the next poll comes within a second
        if held:
            break
        page.wait_for_timeout(100)
    assert held, "the panel did not poll"
    route, answer = held[0]
    assert "data-cancel" in answer.text()  # the answer carries the actions, as they were before the cancel

    page.once("dialog", lambda dialog: dialog.accept())
    panel.locator("[data-cancel]").click()
    expect(panel.get_by_role("status")).to_contain_text("cancelled", timeout=10_000)
    expect(panel.locator("[data-cancel]")).to_have_count(0)

    route.fulfill(response=answer)
    page.wait_for_timeout(1500)
    expect(panel.locator("[data-cancel]")).to_have_count(0)
    expect(panel.get_by_label("Name", exact=True)).to_have_count(0)
    expect(panel.locator(".badge").first).to_have_text("Cancelled")
    assert page.errors == []


def test_a_cancel_answered_after_a_poll_replaced_the_actions_still_updates_the_calendar(world, live_server, new_page,
                                                                                       sign_in, day, monkeypatch):
    """The panel's Cancel link sent the cancel; a poll answered meanwhile with new actions (the booking renamed
    elsewhere), replacing the link. The cancel's answer then told its detached link that the booking changed:
    htmx dispatches HX-Trigger's events on the element that sent the request, so the calendar never heard it and
    went on showing the cancelled booking. The cancel now says it after the swap, which htmx dispatches on the
    page's body when that element is gone."""
    from reservations.models import Reservation

    page, r = open_polling_panel(world, live_server, new_page, sign_in, day, monkeypatch, "slow cancel")
    event = page.locator(f".fc-event[data-reservation-id='{r.pk}']")
    panel = page.locator("#side-panel")

    held: list = []
    page.route("**/cancel/", lambda route: held.append(route))  # a slow cancel: held until released below
    page.once("dialog", lambda dialog: dialog.accept())
    panel.locator("[data-cancel]").click()
    for _ in range(50):
        if held:
            break
        page.wait_for_timeout(100)
    assert held, "the cancel was not sent"

    Reservation.objects.filter(pk=r.pk).update(name="renamed elsewhere")
    expect(panel.locator("input[name=shown_name]")).to_have_value("renamed elsewhere", timeout=10_000)
    held[0].continue_()
    expect(panel.get_by_role("status")).to_contain_text("cancelled", timeout=10_000)
    expect(event).to_have_count(0, timeout=10_000)  # the calendar fetched its events again
    assert page.errors == []


def test_a_failing_poll_says_so_once_and_clears_when_it_answers_again(world, live_server, new_page, sign_in, day,
                                                                     monkeypatch):
    """A poll that kept failing (the portal down, a 500) took its error out and put it back every few seconds as a
    new role=alert paragraph: a screen reader read "Something went wrong" again at every poll. The same error is now
    said once while the poll keeps failing, and taken away once a poll answers again (a 204 swaps nothing, so the
    error stayed on a panel that worked again)."""
    page, r = open_polling_panel(world, live_server, new_page, sign_in, day, monkeypatch, "flaky poll")
    live = page.locator(f"#panel-live-{r.pk}")
    page.evaluate("""() => {
        window.alertsAdded = 0;
        new MutationObserver((records) => {
            for (const rec of records) for (const n of rec.addedNodes)
                if (n.nodeType === 1 && n.matches("[data-htmx-error]")) window.alertsAdded += 1;
        }).observe(document.body, {childList: true, subtree: true});
    }""")
    polls: list[str] = []

    def fail(route):
        polls.append(route.request.url)
        route.fulfill(status=500, body="boom")

    page.route("**/panel/?live=*", fail)
    expect(live.locator("[data-htmx-error]")).to_have_text(
        "Something went wrong (HTTP 500). Try again, or reload the page.", timeout=10_000)
    deadline = 30
    while len(polls) < 4 and deadline:
        page.wait_for_timeout(500)
        deadline -= 1
    assert len(polls) >= 4, polls
    assert page.evaluate("window.alertsAdded") == 1, "the same error was said again at each failing poll"
    assert live.locator("[data-htmx-error]").count() == 1

    page.unroute("**/panel/?live=*")
    expect(live.locator("[data-htmx-error]")).to_have_count(0, timeout=10_000)  # answered (204): error gone
    expect(page.locator("[data-htmx-error]")).to_have_count(0)


def test_a_panel_whose_booking_is_out_of_sight_says_so_and_stops_polling(world, live_server, new_page, sign_in, day,
                                                                        monkeypatch):
    """A panel left open after the user's place in the team ended got a 404 at every poll: it said "Something went
    wrong (HTTP 404)" and went on asking every 3 s for as long as the page stayed open. The poll is now answered 286:
    the part says why and htmx stops polling it."""
    from tenants.models import Membership

    page, r = open_polling_panel(world, live_server, new_page, sign_in, day, monkeypatch, "gone from view")
    live = page.locator(f"#panel-live-{r.pk}")
    Membership.objects.filter(user=world.users["alpha-lead"]).delete()
    expect(live).to_contain_text("You can no longer see this booking", timeout=10_000)
    expect(live.locator("[data-htmx-error]")).to_have_count(0)
    assert live.get_attribute("hx-trigger") is None
    polls: list[str] = []
    page.on("request", lambda req: polls.append(req.url) if "/panel/" in req.url else None)
    page.wait_for_timeout(2500)  # 1 s polls: two or three would have gone by
    assert polls == []
    expect(page.locator("#side-panel h2")).to_contain_text("gone from view")  # the heading stays where it was
    assert page.errors == []
