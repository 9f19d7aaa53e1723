"""ReservationSerializer builds its body directly (issue #2): it must say exactly what its declared
fields say, for every shape of reservation the API answers with."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from rest_framework import serializers

from reservations import services
from reservations.api.serializers import ReservationSerializer
from reservations.api.views import ReservationViewSet
from reservations.choices import ReservationStatus
from reservations.models import Reservation

from .conftest import iso

pytestmark = pytest.mark.django_db


def by_fields(instance):
    """The rendering DRF's ModelSerializer makes from the declared fields."""
    serializer = ReservationSerializer(instance)
    return serializers.ModelSerializer.to_representation(serializer, instance)


def listed(world, reservation_id):
    """The reservation as the list and detail routes read it (prefetched active allocations)."""
    view = ReservationViewSet()
    view.request = type("R", (), {"user": world.users["staff"]})()
    view.action = "retrieve"
    return view.get_queryset().get(pk=reservation_id)


def test_a_fresh_booking_renders_as_its_fields_do(world, t0):
    lead = world.users["alpha-lead"]
    fresh = services.reservation_create(actor=lead, tenant=world.tenants["alpha"], pool=world.pool, node_count=3,
                                        start=t0, end=t0 + timedelta(hours=5), name="pretrain ✓ run")
    assert hasattr(fresh, "node_hostnames")
    body = ReservationSerializer(fresh).data
    assert body == by_fields(fresh)
    assert list(body) == list(by_fields(fresh))  # same keys in the same order
    assert body["start"] == iso(t0) and body["created_by"] == "alpha-lead" and len(body["nodes"]) == 3
    assert type(body["status"]) is str and type(body["billing"]) is str


def test_every_stored_shape_renders_as_its_fields_do(world, t0):
    lead = world.users["alpha-lead"]
    committed = services.reservation_create(actor=lead, tenant=world.tenants["alpha"], pool=world.pool, node_count=3,
                                            start=t0, end=t0 + timedelta(hours=2))
    burst = services.reservation_create(actor=lead, tenant=world.tenants["alpha"], pool=world.pool, node_count=1,
                                        start=t0, end=t0 + timedelta(hours=2))
    assert burst.billing == "burst"
    cancelled = services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"],
                                            pool=world.pool, node_count=1, start=t0 + timedelta(days=2),
                                            end=t0 + timedelta(days=2, hours=1))
    services.reservation_cancel(actor=world.users["beta-lead"], reservation=cancelled)
    # No creator (a user since deleted) and a reason on the status.
    orphan = services.reservation_create(actor=world.users["beta-lead"], tenant=world.tenants["beta"],
                                         pool=world.pool, node_count=2, start=t0 + timedelta(days=3),
                                         end=t0 + timedelta(days=3, hours=1))
    Reservation.objects.filter(pk=orphan.pk).update(status=ReservationStatus.FAILED, status_reason="node lost",
                                                    missing_nodes=1)
    get_user_model().objects.filter(pk=world.users["beta-lead"].pk).delete()
    for reservation in (committed, burst, cancelled, orphan):
        stored = listed(world, reservation.pk)
        body = ReservationSerializer(stored).data
        assert body == by_fields(stored), reservation
        assert list(body) == list(by_fields(stored))
    assert ReservationSerializer(listed(world, cancelled.pk)).data["nodes"] == []
    orphan_body = ReservationSerializer(listed(world, orphan.pk)).data
    assert orphan_body["created_by"] is None and orphan_body["status"] == "failed"
    assert orphan_body["status_reason"] == "node lost" and orphan_body["missing_nodes"] == 1


def test_the_api_answers_the_same_body_on_create_and_read(world, t0):
    client = world.client("alpha-lead")
    created = client.post("/api/v1/reservations/", {"pool": "h100", "node_count": 2, "start": iso(t0),
                                                   "end": iso(t0 + timedelta(hours=3)), "name": "x"}, format="json")
    assert created.status_code == 201, created.json()
    read = client.get(f"/api/v1/reservations/{created.json()['id']}/")
    assert read.status_code == 200
    assert created.json() == read.json()
    listed_body = client.get("/api/v1/reservations/").json()["results"]
    assert listed_body == [read.json()]
