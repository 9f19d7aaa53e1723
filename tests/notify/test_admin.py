"""The Django admin: staff only, every edit through the audited services, the quota-lowering warning."""

from __future__ import annotations

import html
import re
from datetime import timedelta
from html.parser import HTMLParser

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from notifications import services as notify
from notifications.models import Channel, Delivery
from notifications.slack import Event
from portal.core.models import AuditLog
from reservations.choices import AllocationKind, NodeState, ReservationStatus
from reservations.models import Allocation, Node, Reservation
from tenants.models import Quota, Tenant
from tenants.selectors import quota_version
from tenants.services import tenant_slack_webhook_set

pytestmark = pytest.mark.django_db

SLACK_URL = "https://hooks.slack.com/services/T000/B000/very-secret-token-xyz"


@pytest.fixture
def staff(world) -> Client:
    client = Client()
    client.force_login(world.users["staff"])
    return client


def _quota(world, slug: str) -> Quota:
    return Quota.objects.get(tenant=world.tenants[slug], pool=world.pool)


def _audits(action: str):
    return list(AuditLog.objects.filter(action=action).order_by("id"))


ADMIN_PAGES = [
    "admin:index", "admin:tenants_tenant_changelist", "admin:tenants_quota_changelist",
    "admin:reservations_pool_changelist", "admin:reservations_node_changelist",
    "admin:reservations_reservation_changelist", "admin:notifications_delivery_changelist",
    "admin:notifications_channel_changelist", "admin:core_auditlog_changelist",
]


@pytest.mark.parametrize("page", ADMIN_PAGES)
def test_admin_is_for_staff_only(world, page):
    url = reverse(page)
    anonymous = Client().get(url)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    lead = Client()
    lead.force_login(world.users["alpha-lead"])
    response = lead.get(url)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.mark.parametrize("page", ADMIN_PAGES)
def test_staff_see_every_admin_page(world, staff, page):
    # Platform admins are the staff users: no per-model Django permissions needed.
    assert not world.users["staff"].is_superuser
    assert staff.get(reverse(page)).status_code == 200


def test_quota_edit_is_audited_with_actor_and_old_and_new(world, staff):
    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_change", args=[quota.pk])
    page = staff.get(url)
    assert page.status_code == 200
    response = staff.post(url, {"max_nodes": 4, "burst_nodes": 2, "max_duration_hours": 48, "_save": "Save",
                                "version": _version(page)})
    assert response.status_code == 302, response.content[:2000]
    (audit,) = _audits("quota.update")
    assert audit.actor == world.users["staff"] and audit.tenant_id == world.tenants["alpha"].pk
    assert audit.before == {"max_nodes": 3, "burst_nodes": 1, "max_duration_hours": None}
    assert audit.after == {"max_nodes": 4, "burst_nodes": 2, "max_duration_hours": 48}
    # django-simple-history records the same change with the same user.
    assert quota.history.first().history_user == world.users["staff"]
    assert quota.history.first().max_nodes == 4


def _version(page) -> str:
    """The hidden version field the quota's change form was rendered with (what the browser posts back)."""
    match = re.search(r'<input type="hidden" name="version" value="([^"]*)"', page.content.decode())
    assert match, "the quota's change form has no version field"
    return html.unescape(match.group(1))


def test_a_stale_quota_form_does_not_overwrite_a_newer_edit(world, staff):
    """Two admins open the same quota; the first saves; the second's later save (of the numbers they saw)
    is refused with a form error, not applied over the first's change."""
    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_change", args=[quota.pk])
    other = Client()
    other.force_login(get_user_model().objects.create_user(username="staff2", password="pw-Long-enough-1",
                                                            is_staff=True))
    first, second = staff.get(url), other.get(url)
    assert first.status_code == second.status_code == 200

    saved = staff.post(url, {"max_nodes": 5, "burst_nodes": 1, "max_duration_hours": "", "_save": "Save",
                             "version": _version(first)})
    assert saved.status_code == 302, saved.content[:2000]

    stale = other.post(url, {"max_nodes": 3, "burst_nodes": 2, "max_duration_hours": 24, "_save": "Save",
                             "version": _version(second)})
    assert stale.status_code == 200
    text = stale.content.decode()
    assert "errornote" in text and "changed since you opened" in text
    assert 'name="max_nodes" value="5"' in text  # shown the numbers now stored, to redo the change on
    assert f'name="version" value="{quota_version(Quota.objects.get(pk=quota.pk))}"' in html.unescape(text)
    quota.refresh_from_db()
    assert (quota.max_nodes, quota.burst_nodes, quota.max_duration_hours) == (5, 1, None)
    assert [a.actor.username for a in _audits("quota.update")] == ["staff"]

    # Reloaded, the second admin sees the first's numbers and can save over them knowingly.
    again = other.get(url)
    assert 'name="max_nodes" value="5"' in again.content.decode()
    done = other.post(url, {"max_nodes": 5, "burst_nodes": 2, "max_duration_hours": 24, "_save": "Save",
                            "version": _version(again)})
    assert done.status_code == 302
    quota.refresh_from_db()
    assert (quota.max_nodes, quota.burst_nodes, quota.max_duration_hours) == (5, 2, 24)


def test_a_quota_form_posted_without_its_version_saves_nothing(world, staff):
    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_change", args=[quota.pk])
    response = staff.post(url, {"max_nodes": 4, "burst_nodes": 1, "max_duration_hours": "", "_save": "Save"})
    assert response.status_code == 200 and "errornote" in response.content.decode()
    assert _quota(world, "alpha").max_nodes == 3 and _audits("quota.update") == []


def _list_edit(world, rows: dict[int, dict], **extra) -> dict:
    """The quota list's POST as a browser sends it from a page showing the current numbers: each row's
    numbers as edited, and (hidden) the numbers the page showed."""
    data = {"form-TOTAL_FORMS": str(len(rows)), "form-INITIAL_FORMS": str(len(rows)), "form-MIN_NUM_FORMS": "0",
            "form-MAX_NUM_FORMS": "1000", "_save": "Save", **extra}
    for i, (pk, values) in enumerate(rows.items()):
        quota = Quota.objects.get(pk=pk)
        data[f"form-{i}-id"] = str(pk)
        for field in ("max_nodes", "burst_nodes", "max_duration_hours"):
            value = values.get(field, getattr(quota, field))
            data[f"form-{i}-{field}"] = "" if value is None else str(value)
            shown = getattr(quota, field)
            data[f"initial-form-{i}-{field}"] = "" if shown is None else str(shown)
    return data


def _list_page_post(page, row_of: dict[int, dict]) -> dict:
    """The quota list page's own form, as rendered (every input's name and value), with the given rows' numbers
    changed: {quota id: {field: new value}}."""
    text = page.content.decode()
    inputs = dict(re.findall(r'<input type="(?:hidden|number|text)" name="((?:initial-)?form-[^"]+)" value="([^"]*)"',
                             text))
    inputs.update(re.findall(r'name="(form-(?:TOTAL|INITIAL|MIN_NUM|MAX_NUM)_FORMS)" value="([^"]*)"', text))
    for key, value in list(inputs.items()):
        if key.startswith("form-") and key.endswith("-id") and int(value) in row_of:
            prefix = key[:-len("id")]
            for field, new in row_of[int(value)].items():
                inputs[prefix + field] = str(new)
    return {**inputs, "_save": "Save"}


def test_a_stale_quota_list_does_not_overwrite_a_newer_edit(world, staff):
    """Two admins open the quota list; the first changes alpha's max nodes; the second, on the page opened
    before, changes alpha's burst nodes: that save posted the old max nodes too and wrote them back. It is
    refused now (nothing saved), and the first's change stays."""
    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_changelist")
    other = Client()
    other.force_login(get_user_model().objects.create_user(username="staff2", password="pw-Long-enough-1",
                                                            is_staff=True))
    first, second = staff.get(url), other.get(url)
    assert 'name="initial-form-0-max_nodes"' in first.content.decode()  # the page says what it showed

    saved = staff.post(url, _list_page_post(first, {quota.pk: {"max_nodes": 5}}))
    assert saved.status_code == 302
    assert _quota(world, "alpha").max_nodes == 5

    stale = other.post(url, _list_page_post(second, {quota.pk: {"burst_nodes": 2}}), follow=True)
    assert "changed since you opened" in stale.content.decode()
    quota.refresh_from_db()
    assert (quota.max_nodes, quota.burst_nodes) == (5, 1)
    assert [a.after for a in _audits("quota.update")] == [{"max_nodes": 5, "burst_nodes": 1,
                                                          "max_duration_hours": None}]

    # From a fresh page the same change goes through, over the first admin's numbers.
    done = other.post(url, _list_page_post(other.get(url), {quota.pk: {"burst_nodes": 2}}))
    assert done.status_code == 302
    quota.refresh_from_db()
    assert (quota.max_nodes, quota.burst_nodes) == (5, 2)


def test_in_place_list_edits_go_through_the_audited_service(world, staff):
    alpha, beta = _quota(world, "alpha"), _quota(world, "beta")
    url = reverse("admin:tenants_quota_changelist")
    response = staff.post(url, _list_edit(world, {alpha.pk: {"max_nodes": 4}, beta.pk: {"burst_nodes": 3}}))
    assert response.status_code == 302
    audits = _audits("quota.update")
    assert [(a.tenant_id, a.before["max_nodes"], a.after["max_nodes"], a.before["burst_nodes"],
             a.after["burst_nodes"]) for a in audits] == [
        (world.tenants["alpha"].pk, 3, 4, 1, 1), (world.tenants["beta"].pk, 3, 3, 1, 3)]
    assert {a.actor for a in audits} == {world.users["staff"]}
    assert _quota(world, "alpha").max_nodes == 4 and _quota(world, "beta").burst_nodes == 3


def test_invalid_list_edit_saves_nothing(world, staff):
    alpha = _quota(world, "alpha")
    response = staff.post(reverse("admin:tenants_quota_changelist"),
                          _list_edit(world, {alpha.pk: {"max_nodes": -1}}))
    assert response.status_code == 200 and b"errorlist" in response.content
    assert _audits("quota.update") == [] and _quota(world, "alpha").max_nodes == 3


def test_bulk_action_changes_each_quota_audited(world, staff):
    ids = [_quota(world, "alpha").pk, _quota(world, "beta").pk]
    url = reverse("admin:tenants_quota_changelist")
    form = staff.post(url, {"action": "bulk_change", "_selected_action": ids})
    assert form.status_code == 200 and b"Change the numbers" in form.content
    assert b"on these 2 quotas." in form.content  # was "these 2 quota(s)"
    one = staff.post(url, {"action": "bulk_change", "_selected_action": ids[:1]})
    assert b"on this quota." in one.content and b"numbers of this quota" in one.content  # was "these 1 quota(s)"
    done = staff.post(url, {"action": "bulk_change", "_selected_action": ids[:1], "apply": "1", "max_nodes": "5"},
                      follow=True)
    assert b"1 quota changed." in done.content  # was "1 quota(s) changed."
    done = staff.post(url, {"action": "bulk_change", "_selected_action": ids, "apply": "1", "max_nodes": "6"},
                      follow=True)
    assert b"2 quotas changed." in done.content
    assert sorted(a.after["max_nodes"] for a in _audits("quota.update")) == [5, 6, 6]


def test_lowering_below_bookings_lists_them_before_saving(world, staff, t0, book):
    kept = book("alpha", t0, nodes=3, name="big-run")
    other = book("alpha", t0 + timedelta(days=2), nodes=1, name="small-run")
    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_change", args=[quota.pk])
    post = {"max_nodes": 1, "burst_nodes": 0, "max_duration_hours": "", "_save": "Save",
            "version": _version(staff.get(url))}

    warning = staff.post(url, post)

    assert warning.status_code == 200
    html = warning.content.decode()
    assert "Lower a quota below what is booked?" in html
    assert f'data-reservation="{kept.pk}"' in html and "big-run" in html
    assert f'data-reservation="{other.pk}"' not in html  # 1 node fits the new quota
    assert _quota(world, "alpha").max_nodes == 3 and _audits("quota.update") == []  # nothing saved yet

    confirmed = staff.post(url, {**post, "_confirm_lowering": "yes"})
    assert confirmed.status_code == 302
    assert _quota(world, "alpha").max_nodes == 1
    (audit,) = _audits("quota.update")
    assert (audit.before["max_nodes"], audit.after["max_nodes"]) == (3, 1)
    assert Reservation.objects.get(pk=kept.pk).status == ReservationStatus.CONFIRMED  # bookings are untouched


def test_lowering_warning_on_the_list_and_in_bulk(world, staff, t0, book):
    booked = book("alpha", t0, nodes=2)
    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_changelist")
    data = _list_edit(world, {quota.pk: {"max_nodes": 1, "burst_nodes": 0}})
    warning = staff.post(url, data)
    assert warning.status_code == 200 and f'data-reservation="{booked.pk}"' in warning.content.decode()
    assert _audits("quota.update") == []
    assert staff.post(url, {**data, "_confirm_lowering": "yes"}).status_code == 302
    assert _quota(world, "alpha").max_nodes == 1

    bulk = {"action": "bulk_change", "_selected_action": [quota.pk], "apply": "1", "max_nodes": "0"}
    warning = staff.post(url, bulk)
    assert f'data-reservation="{booked.pk}"' in warning.content.decode()
    assert _quota(world, "alpha").max_nodes == 1
    staff.post(url, {**bulk, "_confirm_lowering": "yes"})
    assert _quota(world, "alpha").max_nodes == 0


class _FormFields(HTMLParser):
    """Every field a page's change form posts, as a browser would: inputs (ticked boxes only), selected options,
    textareas. ``data`` has one value per name (the last); ``values`` every value of an input (ticked boxes of
    one field)."""

    def __init__(self):
        super().__init__()
        self.data: dict[str, str] = {}
        self.values: dict[str, list[str]] = {}
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        name = a.get("name")
        if tag == "input" and name and a.get("type") not in ("submit", "button", "file"):
            if a.get("type") in ("checkbox", "radio") and "checked" not in a:
                return
            self.data[name] = a.get("value") or ("on" if a.get("type") == "checkbox" else "")
            self.values.setdefault(name, []).append(self.data[name])
        elif tag == "select" and name:
            self._select = name
            self.data.setdefault(name, "")
        elif tag == "option" and self._select and "selected" in a:
            self.data[self._select] = a.get("value") or ""
        elif tag == "textarea" and name:
            self._textarea = name
            self.data[name] = ""

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, text):
        if self._textarea:
            self.data[self._textarea] += text


def _form_post(page, **changes) -> dict:
    parser = _FormFields()
    parser.feed(page.content.decode())
    data = {k: v for k, v in parser.data.items() if k != "csrfmiddlewaretoken"}
    data.update({k: str(v) for k, v in changes.items()})
    return {**data, "_save": "Save"}


def test_a_stale_tenant_page_does_not_overwrite_a_newer_quota_edit(world, staff):
    """The tenant page lists its quotas inline and posted every row back: one saved from a page opened before
    another admin changed a quota wrote the old numbers back, even when this admin only renamed the tenant.
    Now a row the admin did not touch is left alone, and one they changed is refused when stale."""
    tenant, quota = world.tenants["alpha"], _quota(world, "alpha")
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    other = Client()
    other.force_login(get_user_model().objects.create_user(username="staff2", password="pw-Long-enough-1",
                                                            is_staff=True))
    opened = other.get(url)
    assert opened.status_code == 200
    quota_url = reverse("admin:tenants_quota_change", args=[quota.pk])
    assert staff.post(quota_url, {"max_nodes": 5, "burst_nodes": 1, "max_duration_hours": "", "_save": "Save",
                                  "version": _version(staff.get(quota_url))}).status_code == 302

    # The quota row changed on the stale page: refused, nothing saved (not the tenant's name either).
    stale = other.post(url, _form_post(opened, name="Alpha Renamed", **{"quotas-0-burst_nodes": 2}))
    assert stale.status_code == 200 and "changed since you opened" in stale.content.decode()
    assert _quota(world, "alpha").burst_nodes == 1 and Tenant.objects.get(pk=tenant.pk).name == "Team Alpha"

    # Only the tenant renamed on the stale page: saved, and the quota keeps the newer numbers.
    renamed = other.post(url, _form_post(opened, name="Alpha Renamed"))
    assert renamed.status_code == 302, renamed.content.decode()[:3000]
    assert Tenant.objects.get(pk=tenant.pk).name == "Alpha Renamed"
    assert (_quota(world, "alpha").max_nodes, _quota(world, "alpha").burst_nodes) == (5, 1)
    assert [a.actor.username for a in _audits("quota.update")] == ["staff"]


def test_a_stale_tenant_page_does_not_revert_the_tenant_or_a_role_changed_since(world, staff):
    """The tenant page posted every field and every member's role back: saved from a page opened before another
    admin renamed the tenant or promoted a member, it renamed it back and demoted them again. Now what this
    admin left alone is not written; what they changed that someone else also changed since is refused."""
    tenant = world.tenants["alpha"]
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    other = Client()
    other.force_login(get_user_model().objects.create_user(username="staff2", password="pw-Long-enough-1",
                                                            is_staff=True))
    first, opened = staff.get(url), other.get(url)
    fields = _form_post(first)

    def row_of(who: str) -> str:
        return next(k.split("-")[1] for k, v in fields.items()
                    if k.startswith("memberships-") and k.endswith("-user") and v == str(world.users[who].pk))

    member_row, viewer_row = row_of("alpha-member"), row_of("alpha-viewer")
    done = staff.post(url, _form_post(first, name="Alpha One", **{f"memberships-{member_row}-role": "lead"}))
    assert done.status_code == 302, done.content.decode()[:3000]

    # Left alone on the stale page: the name and the member's role stay as the first admin set them.
    saved = other.post(url, _form_post(opened, storage_quota_tib=20, **{f"memberships-{viewer_row}-role": "member"}))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    tenant.refresh_from_db()
    assert (tenant.name, tenant.storage_quota_tib) == ("Alpha One", 20)
    roles = dict(tenant.memberships.values_list("user__username", "role"))
    assert roles["alpha-member"] == "lead" and roles["alpha-viewer"] == "member"

    # Changed on the stale page too: refused, nothing saved.
    for change in ({"name": "Alpha Two"}, {f"memberships-{member_row}-role": "viewer"}):
        stale = other.post(url, _form_post(opened, **change))
        assert stale.status_code == 200 and "changed since you opened" in stale.content.decode(), change
    tenant.refresh_from_db()
    assert tenant.name == "Alpha One"
    assert dict(tenant.memberships.values_list("user__username", "role"))["alpha-member"] == "lead"


def test_tenant_page_with_inlines_audits_and_warns(world, staff, t0, book):
    tenant = world.tenants["alpha"]
    booked = book("alpha", t0, nodes=3)
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    page = staff.get(url)
    assert page.status_code == 200
    quota, members = _quota(world, "alpha"), list(tenant.memberships.order_by("id"))
    data = {
        "slug": "alpha", "name": "Team Alpha", "burst_enabled": "on", "storage_quota_tib": "10", "vlan_id": "",
        "cidr": "", "new_slack_webhook_url": "", "_save": "Save",
        "memberships-TOTAL_FORMS": str(len(members)), "memberships-INITIAL_FORMS": str(len(members)),
        "memberships-MIN_NUM_FORMS": "0", "memberships-MAX_NUM_FORMS": "1000",
        "quotas-TOTAL_FORMS": "1", "quotas-INITIAL_FORMS": "1", "quotas-MIN_NUM_FORMS": "0",
        "quotas-MAX_NUM_FORMS": "1000",
        "quotas-0-id": str(quota.pk), "quotas-0-tenant": str(tenant.pk), "quotas-0-pool": str(world.pool.pk),
        "quotas-0-max_nodes": "2", "quotas-0-burst_nodes": "0", "quotas-0-max_duration_hours": "",
        "quotas-0-version": _form_post(page)["quotas-0-version"],  # as the page rendered it
    }
    for i, m in enumerate(members):
        data.update({f"memberships-{i}-id": str(m.pk), f"memberships-{i}-tenant": str(tenant.pk),
                     f"memberships-{i}-user": str(m.user_id), f"memberships-{i}-role": m.role})
    data["memberships-2-role"] = "member"  # the viewer becomes a member

    warning = staff.post(url, data)
    assert warning.status_code == 200 and f'data-reservation="{booked.pk}"' in warning.content.decode()
    assert _quota(world, "alpha").max_nodes == 3

    saved = staff.post(url, {**data, "_confirm_lowering": "yes"})
    assert saved.status_code == 302, saved.content[:3000]
    assert _quota(world, "alpha").max_nodes == 2
    assert [(a.before["role"], a.after["role"]) for a in _audits("membership.update")] == [("viewer", "member")]
    assert _audits("quota.update")[0].actor == world.users["staff"]



def test_turning_burst_off_lists_the_bookings_above_the_new_limit_before_saving(world, staff, t0, book):
    """Turning a tenant's burst off lowers every quota's limit (max + burst → max), as lowering a quota does,
    but the tenant page saved it at once: no word of the burst bookings now above the limit."""
    tenant = world.tenants["alpha"]
    burst = book("alpha", t0, nodes=4)  # 3 guaranteed + 1 burst
    assert burst.billing == "burst"
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    post = _form_post(staff.get(url))
    post.pop("burst_enabled")  # the box unticked
    review = staff.post(url, post)
    body = review.content.decode()
    assert review.status_code == 200 and f'data-reservation="{burst.pk}"' in body, body[:3000]
    assert "burst is turned off" in body and "the new limit is 3" in body
    assert Tenant.objects.get(pk=tenant.pk).burst_enabled is True
    saved = staff.post(url, {**post, "_confirm_lowering": "yes"})
    assert saved.status_code == 302, saved.content.decode()[:3000]
    assert Tenant.objects.get(pk=tenant.pk).burst_enabled is False
    burst.refresh_from_db()
    assert burst.status == ReservationStatus.CONFIRMED  # never cancelled by it


def test_turning_burst_off_without_burst_bookings_saves_at_once(world, staff, t0, book):
    tenant = world.tenants["alpha"]
    book("alpha", t0, nodes=3)  # within the guaranteed nodes
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    post = _form_post(staff.get(url))
    post.pop("burst_enabled")
    assert staff.post(url, post).status_code == 302
    assert Tenant.objects.get(pk=tenant.pk).burst_enabled is False


def test_the_lowering_review_carries_a_typed_slack_url_only_on_a_page_never_stored(world, staff, t0, book):
    """The review re-posts the form as typed, a new Slack URL with it (to its own author, who just typed it, as
    any re-shown form does): so that confirming saves it, the page must never be kept by a browser or proxy."""
    tenant = world.tenants["alpha"]
    book("alpha", t0, nodes=4)
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    post = {**_form_post(staff.get(url)), "new_slack_webhook_url": SLACK_URL}
    post.pop("burst_enabled")
    review = staff.post(url, post)
    assert review.status_code == 200 and "data-reservation=" in review.content.decode()
    assert "no-store" in review["Cache-Control"] and "private" in review["Cache-Control"]
    assert staff.post(url, {**post, "_confirm_lowering": "yes"}).status_code == 302
    tenant.refresh_from_db()
    assert tenant.slack_webhook_url == SLACK_URL and tenant.burst_enabled is False

def test_slack_url_is_never_shown_in_full(world, staff):
    tenant_slack_webhook_set(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], url=SLACK_URL)
    channel = notify.slack_channel_ensure(Tenant.objects.get(slug="alpha"))
    for url in (reverse("admin:tenants_tenant_change", args=[world.tenants["alpha"].pk]),
                reverse("admin:notifications_channel_change", args=[channel.pk]),
                reverse("admin:notifications_channel_changelist"),
                reverse("admin:core_auditlog_changelist")):
        html = staff.get(url).content.decode()
        assert "very-secret-token" not in html and "hooks.slack.com/services" not in html
    assert "••••••••en-xyz" in staff.get(reverse("admin:tenants_tenant_change", args=[world.tenants["alpha"].pk])
                                    ).content.decode()  # the masked tail


def test_staff_replace_the_slack_url_from_the_tenant_page(world, staff):
    tenant = world.tenants["alpha"]
    data = {"slug": "alpha", "name": "Team Alpha", "burst_enabled": "on", "storage_quota_tib": "10",
            "new_slack_webhook_url": SLACK_URL, "_save": "Save",
            "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0",
            "quotas-TOTAL_FORMS": "0", "quotas-INITIAL_FORMS": "0"}
    response = staff.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data)
    assert response.status_code == 302, response.content[:3000]
    assert Tenant.objects.get(pk=tenant.pk).slack_webhook_url == SLACK_URL
    (audit,) = _audits("tenant.slack_webhook")
    assert SLACK_URL not in str(audit.after) and audit.after["slack_webhook_url"].endswith("en-xyz")
    assert _audits("tenant.update") == []  # nothing else changed, so nothing else is recorded


def test_node_actions_go_through_services(world, staff, t0):
    nodes = world.nodes[:2]
    url = reverse("admin:reservations_node_changelist")
    staff.post(url, {"action": "drain", "_selected_action": [n.pk for n in nodes]})
    assert set(Node.objects.filter(pk__in=[n.pk for n in nodes]).values_list("state", flat=True)) == {
        NodeState.DRAINING}
    assert len(_audits("node.update")) == 2

    form = staff.post(url, {"action": "schedule_maintenance", "_selected_action": [nodes[0].pk]})
    assert form.status_code == 200 and b"maintenance window" in form.content.lower()
    start, end = t0, t0 + timedelta(hours=4)
    done = staff.post(url, {"action": "schedule_maintenance", "_selected_action": [nodes[0].pk], "apply": "1",
                            "start": start.strftime("%Y-%m-%d %H:%M:%S"), "end": end.strftime("%Y-%m-%d %H:%M:%S"),
                            "note": "firmware"})
    assert done.status_code == 302
    window = Allocation.objects.get(node=nodes[0], kind=AllocationKind.MAINTENANCE)
    assert (window.period.lower, window.period.upper, window.note) == (start, end, "firmware")
    assert _audits("node.maintenance")[0].actor == world.users["staff"]

    staff.post(url, {"action": "return_to_service", "_selected_action": [n.pk for n in nodes]})
    assert set(Node.objects.filter(pk__in=[n.pk for n in nodes]).values_list("state", flat=True)) == {
        NodeState.AVAILABLE}


def test_maintenance_over_a_booking_is_refused_with_a_message(world, staff, t0, book):
    reservation = book("alpha", t0, nodes=4)  # every node
    node = world.nodes[0]
    response = staff.post(reverse("admin:reservations_node_changelist"), {
        "action": "schedule_maintenance", "_selected_action": [node.pk], "apply": "1",
        "start": t0.strftime("%Y-%m-%d %H:%M:%S"), "end": (t0 + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")},
        follow=True)
    assert "is booked during that window" in response.content.decode()
    assert not Allocation.objects.filter(kind=AllocationKind.MAINTENANCE).exists()
    assert Reservation.objects.get(pk=reservation.pk).status == ReservationStatus.CONFIRMED


def test_reservations_are_read_only_but_can_be_cancelled(world, staff, t0, book):
    reservation = book("alpha", t0)
    page = staff.get(reverse("admin:reservations_reservation_change", args=[reservation.pk]))
    assert page.status_code == 200 and b'name="node_count"' not in page.content
    assert staff.post(reverse("admin:reservations_reservation_change", args=[reservation.pk]),
                      {"node_count": 4}).status_code == 403
    assert staff.get(reverse("admin:reservations_reservation_add")).status_code == 403
    staff.post(reverse("admin:reservations_reservation_changelist"),
               {"action": "cancel", "_selected_action": [reservation.pk]})
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.CANCELLED
    (audit,) = _audits("reservation.cancel")
    assert audit.actor == world.users["staff"]


def test_pool_edits_are_audited(world, staff):
    url = reverse("admin:reservations_pool_change", args=[world.pool.pk])
    response = staff.post(url, {"gpu_model": "H100-SXM5", "gpus_per_node": 8, "slot_minutes": 60,
                                "on_demand_rate": "3.0", "_save": "Save"})
    assert response.status_code == 302
    (audit,) = _audits("pool.update")
    assert audit.before["gpu_model"] == "H100-SXM" and audit.after["gpu_model"] == "H100-SXM5"


def test_delivery_log_and_retry_in_the_admin(world, staff, t0, book, slack_for):
    slack_for("alpha", "https://hooks.slack.com/services/T0/B0/x")
    reservation = book("alpha", t0)
    (delivery,) = notify.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    Delivery.objects.filter(pk=delivery.pk).update(status="failed", last_error="channel_not_found")
    listing = staff.get(reverse("admin:notifications_delivery_changelist"))
    assert b"channel_not_found" in listing.content
    done = staff.post(reverse("admin:notifications_delivery_changelist"),
                      {"action": "retry_now", "_selected_action": [delivery.pk]}, follow=True)
    assert "Queued 1 delivery again." in done.content.decode()  # was "Queued 1 delivery(ies) again."
    assert Delivery.objects.get(pk=delivery.pk).status == "pending"
    assert _audits("notifications.delivery.requeue")[0].actor == world.users["staff"]


def test_rotating_a_secret_in_the_admin_shows_it_once(world, staff, webhook_for):
    channel, old = webhook_for("alpha", "https://ci.example/hook")
    response = staff.post(reverse("admin:notifications_channel_changelist"),
                          {"action": "rotate_secret", "_selected_action": [channel.pk], "post": "yes"})
    new = Channel.objects.get(pk=channel.pk).secret
    assert new != old and new in response.content.decode()
    assert new not in staff.get(reverse("admin:notifications_channel_change", args=[channel.pk])).content.decode()


def test_the_admin_asks_before_rotating_secrets(world, staff, webhook_for, slack_for, settings):
    """The action rotated every selected webhook's secret on "Go", as delete_selected never deletes: it now lists
    what it would rotate (and how long the old secrets keep signing) and rotates only when that is confirmed."""
    settings.PORTAL_NOTIFY_SECRET_OVERLAP_HOURS = 6
    channel, old = webhook_for("alpha", "https://ci.example/hook")
    slack = slack_for("beta", "https://hooks.slack.com/services/T0/B0/x")
    changelist = reverse("admin:notifications_channel_changelist")
    asked = staff.post(changelist, {"action": "rotate_secret", "_selected_action": [channel.pk, slack.pk]})
    assert asked.status_code == 200
    text = asked.content.decode()
    assert channel.label in text and slack.label not in text and "6 hours" in text
    assert 'name="post" value="yes"' in text and f'name="_selected_action" value="{channel.pk}"' in text
    assert 'name="action" value="rotate_secret"' in text
    stored = Channel.objects.get(pk=channel.pk)
    assert stored.secret == old and not stored.previous_secret and old not in text
    assert not _audits("notifications.webhook.rotate")

    # The confirmation, posted as the page has it: rotated once; posted again (a double click), refused.
    fields = {"action": "rotate_secret", "_selected_action": [channel.pk], "post": "yes",
              f"version-{channel.pk}": re.search(rf'name="version-{channel.pk}" value="([^"]+)"', text).group(1)}
    first = staff.post(changelist, fields)
    rotated = Channel.objects.get(pk=channel.pk)
    assert rotated.secret != old and rotated.secret in first.content.decode() and rotated.previous_secret == old
    staff.post(changelist, fields)
    again = Channel.objects.get(pk=channel.pk)
    assert (again.secret, again.previous_secret) == (rotated.secret, old)
    assert len(_audits("notifications.webhook.rotate")) == 1


def test_audit_log_in_the_admin_shows_before_and_after(world, staff):
    from tenants.services import quota_update

    quota_update(actor=world.users["staff"], quota=_quota(world, "alpha"), max_nodes=7)
    listing = staff.get(reverse("admin:core_auditlog_changelist") + f"?tenant_id={world.tenants['alpha'].pk}")
    assert "max_nodes: 3 → 7" in listing.content.decode()


def test_deleting_a_tenants_slack_channel_in_the_admin_stops_its_messages(world, staff, t0, book, slack_for):
    # The Slack URL lives on the tenant: deleting only the channel row let the next event make a new one,
    # subscribed to everything again — staff deleted it and the tenant's Slack kept getting messages.
    channel = slack_for("alpha", "https://hooks.slack.com/services/T0/B0/x", events=[Event.RESERVATION_CHANGED])
    staff.post(reverse("admin:notifications_channel_delete", args=[channel.pk]), {"post": "yes"})

    assert not Channel.objects.filter(tenant=world.tenants["alpha"]).exists()
    reservation = book("alpha", t0)
    assert notify.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk}) == []
    assert not Channel.objects.filter(tenant=world.tenants["alpha"]).exists()
    world.tenants["alpha"].refresh_from_db()
    assert world.tenants["alpha"].slack_webhook_url == ""
    assert _audits("tenant.slack_webhook")[-1].actor == world.users["staff"]


def test_the_platform_channel_is_disabled_not_deleted(world, staff, settings):
    # It comes back from PORTAL_PLATFORM_SLACK_WEBHOOK on the next event, with the default events: a delete
    # would neither stop it nor keep what staff chose. Refused, with the way to stop it.
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    channel = notify.platform_channel_ensure()
    response = staff.post(reverse("admin:notifications_channel_delete", args=[channel.pk]), {"post": "yes"},
                          follow=True)
    assert Channel.objects.filter(pk=channel.pk).exists()
    assert "disable" in response.content.decode().lower()


def test_bulk_delete_with_the_platform_channel_selected_deletes_the_rest_and_reports_only_those(
        world, staff, settings, webhook_for):
    # "Delete selected" ran channel_delete for each row; the platform channel's refusal escaped the
    # changelist (a 500) after the rows before it were already gone. Each refusal is a message now, and
    # the other selected channels are deleted. Django's "delete selected" also counted the selection:
    # "Successfully deleted 2 channels" (and an admin history entry "deleted" for each) while the
    # platform channel's deletion was refused and it stayed.
    from django.contrib.admin.models import DELETION, LogEntry

    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    platform = notify.platform_channel_ensure()
    hook, _ = webhook_for("alpha", "https://ci.alpha.example/hook")
    response = staff.post(reverse("admin:notifications_channel_changelist"),
                          {"action": "delete_selected", "_selected_action": [platform.pk, hook.pk], "post": "yes"},
                          follow=True)
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    assert any("disable" in m for m in shown)
    assert "Successfully deleted 1 channel." in shown, shown
    assert Channel.objects.filter(pk=platform.pk).exists() and not Channel.objects.filter(pk=hook.pk).exists()
    logged = set(LogEntry.objects.filter(action_flag=DELETION).values_list("object_id", flat=True))
    assert logged == {str(hook.pk)}
    assert len(_audits("notifications.channel.delete")) == 1


def test_bulk_delete_with_only_refused_channels_claims_no_deletion(world, staff, settings):
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    platform = notify.platform_channel_ensure()
    response = staff.post(reverse("admin:notifications_channel_changelist"),
                          {"action": "delete_selected", "_selected_action": [platform.pk], "post": "yes"},
                          follow=True)
    shown = [str(m) for m in response.context["messages"]]
    assert not any("Successfully deleted" in m for m in shown), shown
    assert Channel.objects.filter(pk=platform.pk).exists()


@pytest.mark.parametrize("slot_minutes", ["7", "2880"])
def test_a_slot_length_the_pool_services_refuse_is_a_form_error(world, staff, slot_minutes):
    # The pool form took any slot length the column holds; one that does not divide a day was refused by
    # pool_create / pool_update only after the form had been accepted: a redirect to an empty form.
    from reservations.models import Pool

    add = staff.post(reverse("admin:reservations_pool_add"),
                     {"name": "a100", "gpu_model": "A100", "gpus_per_node": 8, "slot_minutes": slot_minutes,
                      "on_demand_rate": "1.0", "_save": "Save"})
    assert add.status_code == 200, add.status_code
    assert "slot_minutes" in add.context["adminform"].form.errors
    assert not Pool.objects.filter(name="a100").exists()
    change = staff.post(reverse("admin:reservations_pool_change", args=[world.pool.pk]),
                        {"gpu_model": "H100-SXM", "gpus_per_node": 8, "slot_minutes": slot_minutes,
                         "on_demand_rate": "2.5", "_save": "Save"})
    assert change.status_code == 200
    assert "slot_minutes" in change.context["adminform"].form.errors
    world.pool.refresh_from_db()
    assert world.pool.slot_minutes == 60 and not _audits("pool.update") and not _audits("pool.create")


@pytest.mark.parametrize("object_id", ["abc", "99999999999999999999", "1.5"])
def test_a_quota_history_page_for_an_id_that_is_no_number_is_a_404(world, staff, object_id):
    # The history page (django-simple-history) looked the id up as given: a database error, a 500.
    staff.raise_request_exception = False
    quota = _quota(world, "alpha")
    assert staff.get(f"/admin/tenants/quota/{object_id}/history/").status_code == 404
    assert staff.get(f"/admin/tenants/quota/{object_id}/history/1/").status_code == 404
    assert staff.get(f"/admin/tenants/quota/{quota.pk}/history/{object_id}/").status_code == 404
    assert staff.get(f"/admin/tenants/quota/{quota.pk}/history/").status_code == 200
    version = quota.history.latest("history_date").pk
    assert staff.get(f"/admin/tenants/quota/{quota.pk}/history/{version}/").status_code == 200


@pytest.mark.parametrize("field", ["max_nodes", "burst_nodes", "max_duration_hours"])
def test_a_bulk_quota_number_the_column_cannot_hold_is_a_form_error(world, staff, field):
    # The bulk form had no upper bound: quota_bulk_update refused 3000000000 only after the form was
    # accepted, so staff were sent back to the list with a message instead of the form with its error.
    ids = [_quota(world, "alpha").pk, _quota(world, "beta").pk]
    response = staff.post(reverse("admin:tenants_quota_changelist"),
                          {"action": "bulk_change", "_selected_action": ids, "apply": "1", field: "3000000000"})
    assert response.status_code == 200 and b"Change the numbers" in response.content
    assert field in response.context["form"].errors
    assert not _audits("quota.update")


def _break(channel: Channel) -> None:
    from django.utils import timezone

    from notifications.models import url_fingerprint

    Channel.objects.filter(pk=channel.pk).update(broken_at=timezone.now(), broken_error="http_410", broken_status=410,
                                                 broken_url_fp=url_fingerprint(channel.target_url()))


def test_clearing_the_broken_flag_reports_which_channels_it_cleared(world, staff, webhook_for):
    # The action said "Cleared; the channels send again." whatever the selection held, and wrote a
    # "repaired" audit row for every selected channel, broken or not: staff could not tell whether it did
    # anything, and a disabled channel does not send again for its flag being cleared.
    broken, _ = webhook_for("alpha", "https://ci.alpha.example/broken")
    healthy, _ = webhook_for("alpha", "https://ci.alpha.example/healthy")
    off, _ = webhook_for("beta", "https://ci.beta.example/off")
    notify.webhook_update(actor=world.users["staff"], channel=off, enabled=False)
    _break(broken)
    _break(off)
    untouched = Channel.objects.get(pk=healthy.pk).updated_at
    response = staff.post(reverse("admin:notifications_channel_changelist"),
                          {"action": "clear_broken", "_selected_action": [broken.pk, healthy.pk, off.pk]}, follow=True)
    shown = " | ".join(str(m) for m in response.context["messages"])
    assert "Cleared the broken flag of 2 channels" in shown, shown
    assert "1 selected channel was not broken" in shown, shown
    assert "disabled" in shown and Channel.objects.get(pk=off.pk).label in shown, shown
    assert "the channels send again" not in shown.lower(), shown
    assert not any(c.is_broken for c in Channel.objects.filter(pk__in=[broken.pk, off.pk]))
    assert Channel.objects.get(pk=healthy.pk).updated_at == untouched
    assert sorted(a.object_id for a in _audits("notifications.channel.repaired")) == sorted(
        [str(broken.pk), str(off.pk)])


def test_clearing_channels_none_of_which_is_broken_claims_nothing(world, staff, webhook_for):
    healthy, _ = webhook_for("alpha", "https://ci.alpha.example/healthy")
    response = staff.post(reverse("admin:notifications_channel_changelist"),
                          {"action": "clear_broken", "_selected_action": [healthy.pk]}, follow=True)
    shown = [str(m) for m in response.context["messages"]]
    assert shown == ["None of the selected channels was broken; nothing was cleared."], shown
    assert not _audits("notifications.channel.repaired")


def test_a_new_url_typed_in_the_channel_admin_is_hidden_from_error_reports(world, staff):
    from django.views.debug import SafeExceptionReporterFilter

    tenant_slack_webhook_set(actor=world.users["staff"], tenant=world.tenants["alpha"], url=SLACK_URL)
    channel = notify.slack_channel_ensure(Tenant.objects.get(slug="alpha"))
    new = "https://hooks.slack.com/services/T000/B000/another-secret-token"
    response = staff.post(reverse("admin:notifications_channel_change", args=[channel.pk]),
                          {"new_url": new, "events": list(channel.events), "enabled": "on"})
    assert response.status_code in (200, 302)
    shown = SafeExceptionReporterFilter().get_post_parameters(response.wsgi_request)
    assert shown["new_url"] != new


def test_a_slack_channel_edit_that_fails_half_way_changes_nothing(world, staff, monkeypatch):
    """The Slack channel's admin page saved the new URL (on the tenant) in one transaction, then the events and
    enabled flag in another: a refusal of the second left the URL changed while the page said nothing was
    saved. Now the URL, events and flag are one service call, one transaction: all saved, or none."""
    from portal.core.exceptions import InvalidState

    tenant_slack_webhook_set(actor=world.users["staff"], tenant=world.tenants["alpha"], url=SLACK_URL)
    channel = notify.slack_channel_ensure(Tenant.objects.get(slug="alpha"))
    before = (list(channel.events), channel.enabled)
    url = reverse("admin:notifications_channel_change", args=[channel.pk])
    new = "https://hooks.slack.com/services/T000/B000/another-secret-token"
    events = [Event.RESERVATION_CHANGED]
    audits = AuditLog.objects.count()

    def refused(*_args, **_kwargs):
        raise InvalidState("refused for the test")

    monkeypatch.setattr(notify, "_validate_events", refused)  # the events part, after the URL's
    response = staff.post(url, {"new_url": new, "events": events, "enabled": ""}, follow=True)
    assert "refused for the test" in [str(m) for m in response.context["messages"]]
    assert Tenant.objects.get(slug="alpha").slack_webhook_url == SLACK_URL
    channel.refresh_from_db()
    assert (channel.events, channel.enabled) == before
    assert AuditLog.objects.count() == audits

    monkeypatch.undo()
    assert staff.post(url, {"new_url": new, "events": events, "enabled": ""}).status_code == 302
    assert Tenant.objects.get(slug="alpha").slack_webhook_url == new
    channel.refresh_from_db()
    assert (channel.events, channel.enabled) == (events, False)
    assert [a.action for a in AuditLog.objects.order_by("id")[audits:]] == [
        "tenant.slack_webhook", "notifications.slack.update"]


def test_a_tenant_page_saved_only_in_part_says_what_was_saved_and_what_was_not(world, staff, monkeypatch):
    """The tenant page saves through the services, each in its own durable transaction: the tenant's fields
    first, then its rows. A row refused then (here a quota changed by someone else after the page was checked,
    but before its row was written) left the tenant's fields saved, while the page showed only the refusal,
    as if nothing had been. Now the message says what was saved and what was not."""
    from portal.core.exceptions import InvalidState
    from tenants import services as tenant_services

    tenant = world.tenants["alpha"]
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    opened = staff.get(url)

    def raced(*, quota, **_kwargs):
        raise InvalidState(f"The quota {quota.tenant}/{quota.pool} was changed since you opened it; reload it "
                           "and make your change again.")

    monkeypatch.setattr(tenant_services, "quota_update", raced)
    response = staff.post(url, _form_post(opened, name="Alpha Renamed", **{"quotas-0-burst_nodes": 2}), follow=True)
    (message,) = [str(m) for m in response.context["messages"]]
    assert Tenant.objects.get(pk=tenant.pk).name == "Alpha Renamed"  # committed before the refusal
    assert _quota(world, "alpha").burst_nodes != 2
    assert message.startswith("This page was saved only in part. Saved: the tenant's name. Not saved: the quota "
                              f"in pool {world.pool.name}"), message
    assert "was changed since you opened it" in message and "nor anything after it on the page" in message


def _channel_page_post(page, **changes) -> dict:
    """What the channel page's Save button posts, as rendered (every ticked event), then changes."""
    parser = _FormFields()
    parser.feed(page.content.decode())
    data: dict = {k: v for k, v in parser.data.items() if k != "csrfmiddlewaretoken"}
    data.update({k: v if len(v) > 1 else v[0] for k, v in parser.values.items() if k != "csrfmiddlewaretoken"})
    data.update(changes)
    return {**data, "_save": "Save"}


def test_a_stale_channel_page_does_not_revert_a_leads_newer_events(world, staff):
    """A lead changes their webhook's events; staff, on the channel's page opened before, only disable it: that
    save posted the old events too and wrote them back over the lead's. Now only what the admin changed is
    written, and a field the admin changed that was changed since is refused (a form error, nothing saved)."""
    lead = world.users["alpha-lead"]
    channel, _ = notify.webhook_create(actor=lead, tenant=world.tenants["alpha"], url="https://93.184.216.34/hook",
                                       name="ops", events=[Event.RESERVATION_CHANGED])
    url = reverse("admin:notifications_channel_change", args=[channel.pk])
    opened = staff.get(url)
    assert opened.status_code == 200
    newer = [Event.RESERVATION_CHANGED, Event.QUOTA_THRESHOLD]
    notify.webhook_update(actor=lead, channel=channel, events=newer)
    audits = AuditLog.objects.count()

    clash = staff.post(url, _channel_page_post(opened, events=[Event.QUOTA_THRESHOLD]))
    assert clash.status_code == 200 and "changed since you opened" in clash.content.decode()
    channel.refresh_from_db()
    assert (channel.events, channel.enabled) == ([str(e) for e in newer], True)
    assert AuditLog.objects.count() == audits

    saved = staff.post(url, _channel_page_post(opened, enabled=""))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    channel.refresh_from_db()
    assert (channel.events, channel.enabled) == ([str(e) for e in newer], False)


def test_a_stale_platform_channel_page_does_not_re_enable_it(world, staff, settings):
    """The platform channel's page passed every field to the service: a page opened before another admin
    disabled the channel enabled it again when its admin only changed the events."""
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = SLACK_URL
    channel = notify.platform_channel_ensure()
    url = reverse("admin:notifications_channel_change", args=[channel.pk])
    opened = staff.get(url)
    assert opened.status_code == 200 and channel.enabled
    notify.platform_channel_update(actor=world.users["staff"], channel=channel, enabled=False)
    events = [e for e in channel.events if e != Event.RESERVATION_CHANGED] or [Event.QUOTA_THRESHOLD]

    saved = staff.post(url, _channel_page_post(opened, events=events))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    channel.refresh_from_db()
    assert (channel.events, channel.enabled) == (notify._validate_events(events), False)

    clash = staff.post(url, _channel_page_post(opened, enabled=""))
    assert clash.status_code == 200 and "changed since you opened" in clash.content.decode()


def test_a_stale_slack_channel_page_does_not_revert_a_leads_newer_flag(world, staff):
    """The tenant's Slack channel page: a lead disables the channel; staff, on the page opened before, change the
    events only: the channel stays disabled. Changing the events again from that page (they are no longer the
    ones it shows) is refused."""
    tenant_slack_webhook_set(actor=world.users["staff"], tenant=world.tenants["alpha"], url=SLACK_URL)
    channel = notify.slack_channel_ensure(Tenant.objects.get(slug="alpha"))
    url = reverse("admin:notifications_channel_change", args=[channel.pk])
    opened = staff.get(url)
    assert opened.status_code == 200 and channel.enabled
    notify.slack_subscriptions_update(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], enabled=False)

    saved = staff.post(url, _channel_page_post(opened, events=[Event.QUOTA_THRESHOLD]))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    channel.refresh_from_db()
    assert (channel.events, channel.enabled) == ([str(Event.QUOTA_THRESHOLD)], False)

    clash = staff.post(url, _channel_page_post(opened, events=[Event.RESERVATION_CHANGED]))
    assert clash.status_code == 200 and "changed since you opened" in clash.content.decode()
    channel.refresh_from_db()
    assert (channel.events, channel.enabled) == ([str(Event.QUOTA_THRESHOLD)], False)


def test_the_admins_lowering_warning_and_new_secrets_name_the_zone_of_their_times(world, staff, t0, book,
                                                                                 webhook_for):
    """The quota-lowering warning's Start/End and the new-secrets page's "valid until" were bare "Y-m-d H:i",
    with the zone only in a column heading: the times now carry it ("2026-12-03 10:00 UTC")."""
    from datetime import UTC

    from tests.zoned import unzoned_times

    kept = book("alpha", t0, nodes=3, name="big-run")
    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_change", args=[quota.pk])
    warning = staff.post(url, {"max_nodes": 1, "burst_nodes": 0, "max_duration_hours": "", "_save": "Save",
                               "version": _version(staff.get(url))}).content.decode()
    assert f'data-reservation="{kept.pk}"' in warning
    assert f"{kept.start.astimezone(UTC):%Y-%m-%d %H:%M} UTC" in warning
    assert f"{kept.end.astimezone(UTC):%Y-%m-%d %H:%M} UTC" in warning
    assert not unzoned_times(warning), unzoned_times(warning)

    channel, _ = webhook_for("alpha", "https://ci.example/hook")
    from notifications import services as notify_services

    secrets = staff.post(reverse("admin:notifications_channel_changelist"),
                         {"action": "rotate_secret", "_selected_action": [channel.pk], "post": "yes",
                          f"version-{channel.pk}": notify_services.secret_version(channel)}).content.decode()
    channel.refresh_from_db()
    assert f"{channel.previous_secret_expires_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC" in secrets
    assert not unzoned_times(secrets), unzoned_times(secrets)


@pytest.mark.parametrize("hours,reason", [("0", "at least 1"), ("8785", "at most 8784")])
def test_a_quota_duration_out_of_range_is_refused_with_its_own_reason(world, staff, hours, reason):
    """0 hours was refused as "Quota numbers cannot be negative." (the database's constraint, naming the wrong
    rule), and 100000 hours was saved from the admin while the API refuses more than 8784 (a year and a day)."""
    from portal.core.exceptions import InvalidInput
    from tenants import services

    quota = _quota(world, "alpha")
    url = reverse("admin:tenants_quota_change", args=[quota.pk])
    page = staff.get(url)
    response = staff.post(url, {"max_nodes": 3, "burst_nodes": 1, "max_duration_hours": hours, "_save": "Save",
                                "version": _version(page)})
    text = response.content.decode()
    assert response.status_code == 200 and reason in text.lower() and "cannot be negative" not in text
    quota.refresh_from_db()
    assert quota.max_duration_hours is None and not _audits("quota.update")
    with pytest.raises(InvalidInput) as refused:  # the service's own rule, whoever calls it
        services.quota_update(actor=world.users["staff"], quota=quota, max_duration_hours=int(hours))
    assert "max_duration_hours" in refused.value.fields and reason in refused.value.detail
    with pytest.raises(InvalidInput):
        services.quota_bulk_update(actor=world.users["staff"], changes=[(quota.pk, {"max_duration_hours": int(hours)})])
    quota.refresh_from_db()
    assert quota.max_duration_hours is None and not _audits("quota.update")


def test_a_duration_saved_before_the_limit_does_not_block_editing_other_numbers(world, staff):
    """The admin saved any duration up to 2^31-1 hours until it learnt the 8784-hour limit: a quota of 10000
    hours from then is still in the database. The admin's forms judged that unchanged value on every save, so
    the quota's page refused a change of its max nodes, and the list's in-place edit of another tenant's row
    was refused for it ("at most 8784 hours" on a row nobody touched) — a value set earlier must not block
    changing another field (the services judge only what changes). Changing the duration itself is still
    judged."""
    alpha, beta = _quota(world, "alpha"), _quota(world, "beta")
    Quota.objects.filter(pk=beta.pk).update(max_duration_hours=10000)  # saved before the limit

    url = reverse("admin:tenants_quota_changelist")
    saved = staff.post(url, _list_page_post(staff.get(url), {alpha.pk: {"max_nodes": 5}}))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    assert _quota(world, "alpha").max_nodes == 5 and _quota(world, "beta").max_duration_hours == 10000

    page_url = reverse("admin:tenants_quota_change", args=[beta.pk])
    page = staff.get(page_url)
    saved = staff.post(page_url, {"max_nodes": 4, "burst_nodes": 1, "max_duration_hours": "10000", "_save": "Save",
                                  "version": _version(page)})
    assert saved.status_code == 302, saved.content.decode()[:3000]
    beta.refresh_from_db()
    assert (beta.max_nodes, beta.max_duration_hours) == (4, 10000)

    page = staff.get(page_url)
    refused = staff.post(page_url, {"max_nodes": 4, "burst_nodes": 1, "max_duration_hours": "9000", "_save": "Save",
                                    "version": _version(page)})
    assert refused.status_code == 200 and "at most 8784" in refused.content.decode().lower()
    beta.refresh_from_db()
    assert beta.max_duration_hours == 10000
