"""Two workers meeting the demo tenant's first event at once made two "demo" webhooks (nothing unique names it,
and the row lock of a lookup that finds no row locks nothing): every event was then posted twice. Real threads
on the real database."""

from __future__ import annotations

import pytest
from django.db import connection

from notifications import services
from notifications.choices import ChannelKind
from notifications.models import Channel
from tenants.models import Tenant
from tests.racing import behind_a_lock

from ..conftest import make_world

pytestmark = pytest.mark.django_db(transaction=True)

DEMO_URL = "https://93.184.216.34/demo"


def _ensure():
    try:
        return services.demo_channel_ensure()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc
    finally:
        connection.close()


def test_a_second_worker_waits_for_the_demo_channel_being_made_and_then_uses_it(settings):
    world = make_world()
    settings.PORTAL_DEMO_WEBHOOK_URL = DEMO_URL
    settings.PORTAL_DEMO_TENANT = "alpha"
    tenant = world.tenants["alpha"]
    services._demo_ready.clear()

    def first_worker_making_it() -> None:
        # Another worker's demo_channel_ensure between its lookup (none yet) and its commit.
        Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        Channel.objects.create(tenant=tenant, kind=ChannelKind.WEBHOOK, name="demo", url=DEMO_URL,
                               secret="whsec_" + "A" * 43)

    try:
        second = behind_a_lock(first_worker_making_it, _ensure)
    finally:
        services._demo_ready.clear()
    assert isinstance(second, Channel), second
    assert Channel.objects.filter(tenant=tenant, kind=ChannelKind.WEBHOOK, name="demo").count() == 1
