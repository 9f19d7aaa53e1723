from django.db import migrations


class Migration(migrations.Migration):
    """Let the availability sweep read node ids straight from the GiST index on active periods."""

    dependencies = [("reservations", "0004_reservation_missing_nodes")]

    operations = [
        migrations.RunSQL(
            sql=[
                "DROP INDEX IF EXISTS reservations_allocation_active_period",
                "CREATE INDEX reservations_allocation_active_period_node ON reservations_allocation "
                "USING gist (period) INCLUDE (node_id) WHERE active",
            ],
            reverse_sql=[
                "DROP INDEX IF EXISTS reservations_allocation_active_period_node",
                "CREATE INDEX reservations_allocation_active_period ON reservations_allocation "
                "USING gist (period) WHERE active",
            ],
        ),
    ]
