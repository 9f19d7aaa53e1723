from django.db import migrations


class Migration(migrations.Migration):
    """Index the released allocations' periods, so usage reads a period's allocations off two GiST indexes.

    Usage counts active allocations and released ones (cancelled, swapped, failed teardown); the
    active ones are in the partial GiST indexes on ``WHERE active``, the released ones had none, so the
    usage statement scanned every allocation ever booked. Released allocations are few: a small index.
    """

    dependencies = [("reservations", "0013_reservation_billed_rate")]

    operations = [
        migrations.RunSQL(
            sql="CREATE INDEX reservations_allocation_released_period ON reservations_allocation "
                "USING gist (period) WHERE NOT active",
            reverse_sql="DROP INDEX IF EXISTS reservations_allocation_released_period",
        ),
    ]
