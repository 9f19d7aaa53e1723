from django.db import migrations, models

# A reservation is billed at its pool's on-demand rate and GPUs per node as they were when it was booked,
# so a later change to the pool does not re-price or re-count statements already issued. An insert that
# leaves them out (NULL: the ORM without them, raw SQL such as bench/booking.py) takes the pool's current
# values here, in the database, at the moment of the insert.
FILL_FUNCTION = """
CREATE FUNCTION reservations_reservation_billed_at() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.on_demand_rate IS NULL OR NEW.gpus_per_node IS NULL THEN
        SELECT coalesce(NEW.on_demand_rate, p.on_demand_rate), coalesce(NEW.gpus_per_node, p.gpus_per_node)
        INTO NEW.on_demand_rate, NEW.gpus_per_node
        FROM reservations_pool p WHERE p.id = NEW.pool_id;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER reservations_reservation_billed_at BEFORE INSERT ON reservations_reservation
    FOR EACH ROW EXECUTE FUNCTION reservations_reservation_billed_at();
"""
DROP_FUNCTION = """
DROP TRIGGER IF EXISTS reservations_reservation_billed_at ON reservations_reservation;
DROP FUNCTION IF EXISTS reservations_reservation_billed_at();
"""


class Migration(migrations.Migration):

    dependencies = [
        ('reservations', '0012_reservation_burst_part_nodes'),
    ]

    # Reservations booked before this was recorded take their pool's values now: what their
    # statements showed until today.
    operations = [
        migrations.AddField(
            model_name='reservation',
            name='on_demand_rate',
            field=models.DecimalField(decimal_places=4, editable=False, max_digits=10, null=True),
        ),
        migrations.AddField(
            model_name='reservation',
            name='gpus_per_node',
            field=models.PositiveSmallIntegerField(editable=False, null=True),
        ),
        migrations.RunSQL(
            "UPDATE reservations_reservation r SET on_demand_rate = p.on_demand_rate, gpus_per_node = p.gpus_per_node"
            " FROM reservations_pool p WHERE p.id = r.pool_id",
            reverse_sql=migrations.RunSQL.noop,
        ),
        migrations.RunSQL(FILL_FUNCTION, reverse_sql=DROP_FUNCTION),
        migrations.AlterField(
            model_name='reservation',
            name='on_demand_rate',
            field=models.DecimalField(decimal_places=4, editable=False, max_digits=10),
        ),
        migrations.AlterField(
            model_name='reservation',
            name='gpus_per_node',
            field=models.PositiveSmallIntegerField(editable=False),
        ),
    ]
