from django.db import migrations


class Migration(migrations.Migration):
    """A GiST index on the active allocations' period alone, for availability sweeps over a pool."""

    dependencies = [("reservations", "0002_initial")]

    operations = [
        migrations.RunSQL(
            sql="CREATE INDEX reservations_allocation_active_period ON reservations_allocation "
            "USING gist (period) WHERE active",
            reverse_sql="DROP INDEX reservations_allocation_active_period",
        ),
    ]
