"""`manage.py seed_demo` converges: a run cut off part-way (an error, a killed process) is completed by
the next run, and a run over a complete seed changes nothing."""

from __future__ import annotations

from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from reservations.management.commands import seed_demo
from reservations.models import Node, Pool, Reservation
from tenants.models import Membership, Quota, Tenant

pytestmark = pytest.mark.django_db


def snapshot() -> dict[str, set]:
    return {
        "pools": set(Pool.objects.values_list("name", "gpus_per_node")),
        "nodes": set(Node.objects.values_list("hostname", "pool__name")),
        "tenants": set(Tenant.objects.values_list("slug", "vlan_id", "cidr")),
        "users": set(get_user_model().objects.values_list("username", flat=True)),
        "memberships": set(Membership.objects.values_list("tenant__slug", "user__username", "role")),
        "quotas": set(Quota.objects.values_list("tenant__slug", "pool__name", "max_nodes", "burst_nodes")),
        "bookings": set(Reservation.objects.values_list("tenant__slug", "pool__name", "period", "node_count",
                                                        "name")),
    }


def assert_fully_seeded() -> None:
    for slug, _name, _burst, _vlan, _cidr, quotas in seed_demo.TENANTS:
        tenant = Tenant.objects.get(slug=slug)
        assert set(Membership.objects.filter(tenant=tenant).values_list("user__username", "role")) == {
            (f"{slug}-{role}", role) for role in ("lead", "member", "viewer")}
        assert set(Quota.objects.filter(tenant=tenant).values_list("pool__name", flat=True)) == set(quotas)
        for pool_name in quotas:
            assert Reservation.objects.filter(tenant=tenant, pool__name=pool_name).exists(), (slug, pool_name)
    # Every booking window is booked once: a resumed run never books a window a second time.
    periods = list(Reservation.objects.values_list("tenant__slug", "pool__name", "period"))
    assert len(periods) == len(set(periods))


def seed() -> None:
    call_command("seed_demo", verbosity=0, stdout=mock.Mock())


def assert_rerun_completes_and_then_stays() -> None:
    """The next seed_demo completes what is missing, and one more run after it changes nothing."""
    seed()
    assert_fully_seeded()
    seeded = snapshot()
    seed()
    assert snapshot() == seeded


def interrupted_run(after_bookings: int) -> None:
    """seed_demo as if killed once after_bookings bookings had committed."""
    real = seed_demo.reservation_create
    made = 0

    def book(**kwargs):
        nonlocal made
        if made == after_bookings:
            raise KeyboardInterrupt
        reservation = real(**kwargs)
        made += 1
        return reservation

    with mock.patch.object(seed_demo, "reservation_create", side_effect=book), pytest.raises(KeyboardInterrupt):
        seed()
    assert made == after_bookings


def test_a_run_cut_off_in_the_first_tenants_bookings_is_completed_by_the_next():
    interrupted_run(after_bookings=3)
    # The first tenant has a few bookings in its first pool only, the others none.
    assert Reservation.objects.count() == 3
    assert set(Reservation.objects.values_list("tenant__slug", "pool__name")) == {("research", "h100-sxm")}
    kept = set(Reservation.objects.values_list("pk", flat=True))

    seed()
    assert_fully_seeded()
    assert kept <= set(Reservation.objects.values_list("pk", flat=True))
    seeded = snapshot()

    seed()
    assert snapshot() == seeded


def test_a_run_cut_off_in_a_later_pool_is_completed():
    interrupted_run(after_bookings=12)
    assert_rerun_completes_and_then_stays()


def test_a_tenant_left_without_members_or_quotas_is_completed():
    call_command("seed_demo", no_bookings=True, verbosity=0, stdout=mock.Mock())
    Membership.objects.filter(tenant__slug="inference").exclude(role="lead").delete()
    Quota.objects.filter(tenant__slug="inference").delete()

    assert_rerun_completes_and_then_stays()


def test_an_error_in_one_tenants_setup_leaves_none_of_that_tenant_behind():
    real = Quota.objects.get_or_create

    def quota(**kwargs):
        if kwargs["tenant"].slug == "inference":
            raise RuntimeError("cut off")
        return real(**kwargs)

    with mock.patch.object(Quota.objects, "get_or_create", side_effect=quota), pytest.raises(RuntimeError):
        seed()
    assert not Tenant.objects.filter(slug="inference").exists()
    assert not Membership.objects.filter(user__username__startswith="inference-").exists()

    seed()
    assert_fully_seeded()


def test_a_seeded_booking_moved_since_is_not_booked_again_at_its_old_window():
    """A demo booking whose window changed after seeding (an edit, through the service) is still the seed's
    booking of that window: the next run books nothing in its place."""
    from datetime import timedelta

    from django.utils import timezone

    from reservations.services import reservation_update

    seed()
    now = timezone.now()
    moved = next(r for r in Reservation.objects.select_related("tenant", "pool").order_by("pk")
                 if r.period.lower > now + timedelta(hours=2) and r.period.upper - r.period.lower >= timedelta(hours=2))
    lead = get_user_model().objects.get(username=f"{moved.tenant.slug}-lead")
    slot = timedelta(minutes=moved.pool.slot_minutes)
    reservation_update(actor=lead, reservation=moved, start=moved.period.lower + slot)
    count = Reservation.objects.count()
    seeded = snapshot()

    seed()
    assert Reservation.objects.count() == count
    assert snapshot() == seeded


def test_a_moved_first_booking_still_names_the_plan_of_a_run_that_crossed_midnight():
    """The plan is the one holding the first booking's window, looked up under the day it was made and the day
    before (a run begun just before midnight made it after): that is the window it was booked for, not the one
    it was moved to, or the next run books the next day's whole plan beside the demo."""
    from datetime import UTC, datetime, time, timedelta

    from django.utils import timezone

    from reservations.services import reservation_update

    seed()
    research = Tenant.objects.get(slug="research")
    tomorrow = datetime.combine(timezone.now().astimezone(UTC).date() + timedelta(days=1), time.min, tzinfo=UTC)
    # As if this run had begun just before midnight: every booking made just after it, the first one first.
    Reservation.objects.filter(tenant=research).update(created_at=tomorrow + timedelta(seconds=30))
    first = Reservation.objects.filter(tenant=research, period__startswith__gt=timezone.now() + timedelta(hours=2),
                                       period__endswith__gt=timezone.now()).order_by("pk").first()
    assert first is not None
    Reservation.objects.filter(pk=first.pk).update(created_at=tomorrow + timedelta(seconds=1))
    slot = timedelta(minutes=first.pool.slot_minutes)
    assert first.period.upper - first.period.lower >= 2 * slot  # the plan's shortest booking is 4 h
    reservation_update(actor=get_user_model().objects.get(username="research-lead"), reservation=first,
                       start=first.period.lower + slot)
    count = Reservation.objects.count()

    seed()
    assert Reservation.objects.count() == count
