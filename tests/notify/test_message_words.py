"""What a team reads of a notice: counts in words, no other team's processes."""

from __future__ import annotations

import pytest

from notifications import selectors
from notifications.models import Delivery, QuotaAlertState
from notifications.slack import Event

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("peak", "words"), [(1, "1 node booked"), (3, "3 nodes booked")])
def test_a_quota_alert_skipped_below_the_threshold_counts_in_words(world, peak, words):
    quota = world.tenants["alpha"].quotas.get()
    QuotaAlertState.objects.create(quota=quota, above=False, crossings=1, last_peak=peak)
    delivery = Delivery(event=Event.QUOTA_THRESHOLD, key=f"{Event.QUOTA_THRESHOLD}:q{quota.pk}:n1|c1")

    reason = selectors.quota_alert_obsolete(delivery)

    assert reason == f"quota_below_threshold: {words} at the last check"  # was "1 node(s) booked"
