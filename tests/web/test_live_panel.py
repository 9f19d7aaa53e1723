"""The calendar's side panel and the reservation page stay current without a reload.

The panel showed a booking's hostnames only and never polled: a lead watching it after booking saw the status
(confirmed → provisioning → active), a node drained or swapped and the cluster coming up only on a reload. A booking
whose cluster row did not exist yet (a worker creates it just after the booking commits) showed a placeholder that
did not poll, so its page never showed the cluster either."""

from __future__ import annotations

import html
import re

import pytest

from reservations.models import Reservation

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def _live(body: str, pk: int) -> str:
    """The panel's live part (its opening tag and contents)."""
    match = re.search(rf'<div id="panel-live-{pk}"[^>]*>.*?</dl>\s*</div>', body, re.S)
    assert match, body
    return match.group(0)


def _poll(body: str, pk: int) -> tuple[str | None, str | None]:
    """The URL the live part polls (as the browser reads it) and how often, or (None, None)."""
    tag = re.search(rf'<div id="panel-live-{pk}"[^>]*>', body).group(0)
    url = re.search(r'hx-get="([^"]*)"', tag)
    every = re.search(r'hx-trigger="every (\d+s)"', tag)
    assert bool(url) == bool(every), tag
    return (html.unescape(url.group(1)), every.group(1)) if url else (None, None)


def _nodes(body: str, pk: int) -> list[str]:
    """The live part's node list as it reads: "h100-001", "h100-002 Draining"."""
    dd = re.search(r"<dt>Nodes</dt><dd>(.*?)</dd>", _live(body, pk), re.S).group(1)
    return [" ".join(re.sub(r"<[^>]+>", " ", li).split()) for li in re.findall(r"<li>(.*?)</li>", dd, re.S)]


def _oob_actions(body: str, pk: int, *, replacing: str) -> re.Match | None:
    """The answer's out-of-band actions (what they show, their contents), replacing those the polled URL said the
    panel shows, and no others."""
    was = re.search(r"actions=([0-9a-f]{8})", replacing).group(1)
    return re.search(rf'<div id="panel-actions-{pk}" data-actions="([0-9a-f]{{8}})" '
                     rf"""hx-swap-oob="outerHTML:#panel-actions-{pk}\[data-actions='{was}'\]">(.*?)</div>\s*$""",
                     body, re.S)


def test_the_panel_shows_the_nodes_states_the_cluster_and_polls_while_the_booking_can_change(world, web, book, t0):
    from reservations.services import node_update

    r = book("alpha-lead", t0, nodes=2, name="pretrain")
    held = sorted(r.allocations.filter(active=True).values_list("node__hostname", flat=True))
    node_update(actor=world.users["staff"], node=world.nodes[[n.hostname for n in world.nodes].index(held[0])],
                state="draining", reason="health check failed")
    body = web("alpha-viewer").get(f"/reservations/{r.pk}/panel/", **HTMX).content.decode()
    assert _nodes(body, r.pk) == [f"{held[0]} Draining", held[1]]
    live = _live(body, r.pk)
    assert 'class="badge st-confirmed"' in live and "<dt>Cluster</dt>" in live
    url, every = _poll(body, r.pk)
    assert every == "3s"
    assert re.fullmatch(rf"/reservations/{r.pk}/panel/\?live=[0-9a-f]{{8}}&actions=[0-9a-f]{{8}}&event=[0-9a-f]{{8}}",
                        url), url
    # the live part is a polite live region of its own; the panel around it is not one (its forms would be read out)
    assert re.search(rf'<div aria-live="polite"><div id="panel-live-{r.pk}"', body)
    assert body.count("aria-live") == 1
    # the heading focus goes to and the actions are outside the polled part
    assert "panel-title" not in live and "data-cancel" not in live
    actions = re.search(r"actions=([0-9a-f]{8})", url).group(1)
    assert f'<div id="panel-actions-{r.pk}" data-actions="{actions}">' in body


def test_the_panels_poll_answers_only_when_something_changed_and_leaves_the_actions_alone(world, web, book, t0):
    from provisioning.models import VirtualCluster
    from provisioning.services import cluster_create_for_reservation
    from reservations.services import node_update

    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    url, _ = _poll(client.get(f"/reservations/{r.pk}/panel/", **HTMX).content.decode(), r.pk)

    same = client.get(url, **HTMX)
    assert same.status_code == 204 and same.content == b"" and "HX-Request" in same["Vary"]

    # the booking moves on: the live part comes again (saying so), the calendar is told to refetch its events,
    # and the actions (a name being typed) are left alone, as they did not change
    Reservation.objects.filter(pk=r.pk).update(status="provisioning")
    moved = client.get(url, **HTMX)
    assert moved.status_code == 200 and "reservation-changed" in moved["HX-Trigger"]
    body = moved.content.decode()
    assert 'class="badge st-provisioning"' in _live(body, r.pk)
    assert "panel-actions" not in body and "<h2" not in body and "<section" not in body
    url, every = _poll(body, r.pk)
    assert every == "3s"
    assert client.get(url, **HTMX).status_code == 204  # the next poll says what it now shows

    # its cluster row appears and comes up: the panel shows its status (no calendar refetch: the event looks the same)
    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    with_cluster = client.get(url, **HTMX)
    assert with_cluster.status_code == 200 and "HX-Trigger" not in with_cluster
    badge = re.search(r"<dt>Cluster</dt><dd>(.*?)</dd>", with_cluster.content.decode(), re.S).group(1)
    assert f'href="/clusters/{cluster.pk}/"' in badge and "Pending" in badge, badge
    url, _ = _poll(with_cluster.content.decode(), r.pk)
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="installing_drivers")
    drivers = client.get(url, **HTMX).content.decode()
    assert "Installing drivers" in _live(drivers, r.pk)
    url, _ = _poll(drivers, r.pk)

    # under way: still watched (a node can fail and be swapped), more slowly
    Reservation.objects.filter(pk=r.pk).update(status="active")
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="ready")
    active = client.get(url, **HTMX).content.decode()
    url, every = _poll(active, r.pk)
    assert every == "15s" and "panel-actions" not in active

    (node,) = [a.node for a in r.allocations.filter(active=True).select_related("node")]
    node_update(actor=world.users["staff"], node=node, state="draining", reason="health check failed")
    draining = client.get(url, **HTMX)
    assert _nodes(draining.content.decode(), r.pk) == [f"{node.hostname} Draining"]
    assert "HX-Trigger" not in draining and "panel-actions" not in draining.content.decode()
    url, _ = _poll(draining.content.decode(), r.pk)

    # ending: it can no longer be extended, so the actions come again (out-of-band, replacing those the panel said
    # it shows, and saying what they now show, as the next poll does), without the extend forms
    Reservation.objects.filter(pk=r.pk).update(status="ending")
    ending = client.get(url, **HTMX).content.decode()
    actions = _oob_actions(ending, r.pk, replacing=url)
    assert actions and "data-cancel" in actions.group(2) and "+1 slot" not in actions.group(2), ending
    url, every = _poll(ending, r.pk)
    assert every == "3s" and f"actions={actions.group(1)}&" in url

    # over: the last answer no longer polls, and offers no change
    Reservation.objects.filter(pk=r.pk).update(status="completed")
    done = client.get(url, **HTMX).content.decode()
    assert _poll(done, r.pk) == (None, None) and 'class="badge st-completed"' in done
    actions = _oob_actions(done, r.pk, replacing=url)
    assert actions and "data-cancel" not in actions.group(2), done


@pytest.mark.parametrize("actions", ["", "zzzzzzzz", "4e6998d0']", "'],body", "a" * 5000])
def test_a_poll_whose_actions_marker_is_no_digest_gets_no_actions_and_never_its_words_back(world, web, book, t0,
                                                                                          actions):
    """The answer's out-of-band actions name those they replace by the digest the poll sent: a marker that is no
    digest (hand-made, cut short, a selector of its own) names none, and is never written into the answer."""
    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    url, _ = _poll(client.get(f"/reservations/{r.pk}/panel/", **HTMX).content.decode(), r.pk)
    bad = re.sub(r"actions=[0-9a-f]{8}", "actions=" + actions, url)
    response = client.get(bad, **HTMX)
    body = response.content.decode()
    assert response.status_code == 200 and f'<div id="panel-live-{r.pk}"' in body
    assert "panel-actions" not in body and "hx-swap-oob" not in body, body
    if actions:
        assert actions not in body


@pytest.mark.parametrize("status", ["completed", "cancelled", "failed"])
def test_the_panel_of_a_booking_that_is_over_does_not_poll(world, web, book, t0, status):
    r = book("alpha-lead", t0)
    Reservation.objects.filter(pk=r.pk).update(status=status)
    body = web("alpha-lead").get(f"/reservations/{r.pk}/panel/", **HTMX).content.decode()
    assert _poll(body, r.pk) == (None, None) and "hx-trigger" not in body
    assert f'class="badge st-{status}"' in _live(body, r.pk)


def test_the_panel_a_cancel_answers_with_no_longer_polls(world, web, book, t0):
    r = book("alpha-lead", t0)
    body = web("alpha-lead").post(f"/reservations/{r.pk}/cancel/", **HTMX).content.decode()
    assert "cancelled; its nodes are free again" in body
    assert _poll(body, r.pk) == (None, None) and 'class="badge st-cancelled"' in _live(body, r.pk)


def test_another_tenants_panel_is_404_and_its_poll_stops_as_for_a_booking_that_never_was(world, web, book, t0):
    """Another tenant's panel is 404. Its poll (a panel left open after the user's place in the team ended, or after
    someone else signed in in this browser) was a 404 too, and htmx went on polling it every 3 s, for good. It is now
    answered 286, which stops htmx polling, with the part saying why: the same answer as for an id that never
    existed, so it tells nothing of the booking."""
    r = book("beta-lead", t0, name="beta-secret")
    url, _ = _poll(web("beta-lead").get(f"/reservations/{r.pk}/panel/", **HTMX).content.decode(), r.pk)
    client = web("alpha-lead")
    response = client.get(f"/reservations/{r.pk}/panel/", **HTMX)
    assert response.status_code == 404 and b"beta-secret" not in response.content
    target = {"HTTP_HX_TARGET": f"panel-live-{r.pk}"}  # what htmx sends: the id of the part it polls
    poll = client.get(url, **HTMX, **target)
    never = client.get(url.replace(f"/reservations/{r.pk}/", "/reservations/987654/"), **HTMX, **target)
    assert poll.status_code == never.status_code == 286
    assert poll.content == never.content
    body = poll.content.decode()
    assert "You can no longer see this booking" in body and "beta-secret" not in body
    assert re.fullmatch(rf'\s*<div id="panel-live-{r.pk}">\s*<p class="warn">[^<]*</p>\s*</div>\s*',
                        body), body  # the live part alone, with nothing left that polls
    # Without a plausible part to replace, it is the 404 it was.
    for headers in ({}, {"HTTP_HX_TARGET": ""}, {"HTTP_HX_TARGET": '"><script>'}):
        assert client.get(url, **HTMX, **headers).status_code == 404
    assert client.get(url).status_code == 404  # not htmx at all


def test_the_panels_poll_stops_once_its_booking_is_out_of_the_users_sight(world, web, book, t0):
    from tenants.models import Membership

    r = book("alpha-lead", t0, name="pretrain")
    client = web("alpha-viewer")
    url, every = _poll(client.get(f"/reservations/{r.pk}/panel/", **HTMX).content.decode(), r.pk)
    assert every and client.get(url, **HTMX).status_code == 204  # polling, nothing changed
    Membership.objects.filter(user=world.users["alpha-viewer"]).delete()
    response = client.get(url, **HTMX, HTTP_HX_TARGET=f"panel-live-{r.pk}")
    assert response.status_code == 286 and b"pretrain" not in response.content
    assert b"You can no longer see this booking" in response.content


def _cluster_block(body: str) -> str:
    return re.search(r'<section class="card" aria-labelledby="cluster-title" id="cluster"[^>]*>', body).group(0)


def test_the_page_polls_while_its_cluster_row_does_not_exist_and_the_cluster_card_takes_over(world, web, book, t0):
    """A booking's page opened before its cluster row existed showed the placeholder, which never polled: the
    cluster and its phases appeared only on a reload. The placeholder now polls the page (saying it shows no
    cluster); the answer is the placeholder again until the row exists, then the cluster's card, whose own poll
    takes over."""
    from provisioning.services import cluster_create_for_reservation

    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    page = client.get(f"/reservations/{r.pk}/").content.decode()
    block = _cluster_block(page)
    assert 'hx-trigger="every 3s"' in block and 'hx-swap="outerHTML"' in block, block
    url = html.unescape(re.search(r'hx-get="([^"]*)"', block).group(1))
    assert url.startswith(f"/reservations/{r.pk}/?shown=confirmed&nodes=") and url.endswith("&cluster=none"), url
    assert 'data-placeholder="cluster-phases"' in page

    still = client.get(url, **HTMX).content.decode()
    assert html.unescape(re.search(r'hx-get="([^"]*)"', _cluster_block(still)).group(1)) == url
    assert 'data-placeholder="cluster-phases"' in still and "<h1" not in still
    assert "reservation-status-badge" not in still  # the status did not move

    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    Reservation.objects.filter(pk=r.pk).update(status="provisioning")
    card = client.get(url, **HTMX).content.decode()
    assert re.search(rf'<h2 id="cluster-title">Virtual cluster <a href="/clusters/{cluster.pk}/">', card), card
    assert "data-placeholder" not in card
    status = re.search(r'<section class="card" id="cluster-status"[^>]*>', card).group(0)
    poll = html.unescape(re.search(r'hx-get="([^"]*)"', status).group(1))
    assert poll.startswith(f"/reservations/{r.pk}/?shown=provisioning&") and "cluster=none" not in poll, poll
    assert 'hx-trigger="every 3s"' in status
    assert 'id="reservation-status-badge" hx-swap-oob="true"' in card  # the status moved on: said as ever


def test_the_pages_placeholder_stops_polling_once_the_booking_is_over(world, web, book, t0):
    r = book("alpha-lead", t0)
    client = web("alpha-lead")
    url = html.unescape(re.search(r'hx-get="([^"]*)"',
                                  _cluster_block(client.get(f"/reservations/{r.pk}/").content.decode())).group(1))
    Reservation.objects.filter(pk=r.pk).update(status="cancelled")
    over = client.get(url, **HTMX).content.decode()
    assert "hx-get" not in _cluster_block(over) and 'data-placeholder="no-cluster"' in over
    assert 'id="reservation-status-badge" hx-swap-oob="true"' in over
    page = client.get(f"/reservations/{r.pk}/").content.decode()
    assert "hx-trigger" not in page
    # another tenant's poll learns nothing
    assert web("beta-lead").get(url, **HTMX).status_code == 404


@pytest.mark.parametrize("part", ["booking page", "cluster page", "cluster health"])
def test_the_other_polled_parts_stop_as_the_panel_does_once_out_of_sight(world, web, book, t0, part):
    """The booking page's cluster card, the cluster page's status and its health results poll too: the same 286 and
    notice for another tenant's object as for one that never existed, and the 404 as before for anything else."""
    from provisioning.services import cluster_create_for_reservation

    r = book("beta-lead", t0, name="beta-secret")
    cluster = cluster_create_for_reservation(reservation_id=r.pk)
    url, missing, target, what = {
        "booking page": (f"/reservations/{r.pk}/?shown=confirmed&nodes=x&timeline=y",
                         "/reservations/987654/?shown=confirmed&nodes=x&timeline=y", "cluster-status", "booking"),
        "cluster page": (f"/clusters/{cluster.pk}/", "/clusters/987654/", "cluster-status", "cluster"),
        "cluster health": (f"/health/clusters/{cluster.pk}/results/", "/health/clusters/987654/results/",
                           f"health-results-{cluster.pk}", "cluster"),
    }[part]
    assert web("beta-lead").get(url, **HTMX, HTTP_HX_TARGET=target).status_code == 200  # beta's own: polled as ever
    client = web("alpha-lead")
    poll = client.get(url, **HTMX, HTTP_HX_TARGET=target)
    never = client.get(missing, **HTMX, HTTP_HX_TARGET=target)
    assert poll.status_code == never.status_code == 286 and poll.content == never.content
    assert f"You can no longer see this {what}:" in poll.content.decode()
    assert f'<div id="{target}">' in poll.content.decode() and b"beta-secret" not in poll.content
    assert client.get(url).status_code == 404
    if part == "booking page":  # the page itself, fetched by htmx but not as its poll
        assert client.get(f"/reservations/{r.pk}/", **HTMX, HTTP_HX_TARGET=target).status_code == 404
