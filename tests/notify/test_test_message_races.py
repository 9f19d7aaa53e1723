"""A test message asked for while its channel is deleted: refused as "no such channel", not a 500.

Found in a review: channel_send_test decided the actor's right under the team lock but never looked at the
channel's row again. A lead's "send a test message" queued behind another lead's delete of the same webhook
(both take the team lock first) went on after the delete committed, inserted a delivery naming the deleted
channel, and failed at commit on the foreign key: an IntegrityError, a 500 on the page.
"""

from __future__ import annotations

import pytest

from notifications import services
from notifications.models import Channel, Delivery
from portal.core.exceptions import NotFound
from tenants.choices import Role
from tenants.models import Membership

from ..conftest import make_world
from ..racing import behind_a_lock


@pytest.mark.django_db(transaction=True)
def test_a_test_message_to_a_channel_deleted_meanwhile_is_refused_cleanly(notify_settings):
    world = make_world()
    lead = world.users["alpha-lead"]
    channel, _ = services.webhook_create(actor=lead, tenant=world.tenants["alpha"], url="https://93.184.216.34/hook",
                                         name="ci")

    def another_lead_deletes_it() -> None:  # as channel_delete does: the team lock first, then the row goes
        list(Membership.objects.select_for_update().filter(tenant_id=channel.tenant_id, role=Role.LEAD))
        Channel.objects.filter(pk=channel.pk).delete()

    result = behind_a_lock(another_lead_deletes_it, lambda: services.channel_send_test(actor=lead, channel=channel),
                           waits_on="tenants_membership")

    assert isinstance(result, NotFound), repr(result)
    assert not Delivery.objects.exists()
