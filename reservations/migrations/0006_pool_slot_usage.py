"""Per-slot busy counts of each pool, kept by PostgreSQL on every write (issue #7).

Availability was a sweep over every allocation overlapping the window (~70,000 for a 14-day
window of a 10,000-node pool). Now each write appends per-(pool, slot) deltas from statement
triggers, a compaction folds them into one row per (pool, slot), and a read joins ~1 row per slot.

usage(pool, slot) = number of distinct *available* nodes of the pool with an *active*
allocation touching the slot; slots are multiples of the pool's slot_minutes since the UTC
epoch; a period is read as [lower, upper) like everywhere else.

How a statement's delta is found (ALLOC_FUNCTION below):
- a slot an active allocation covers entirely cannot be touched by another active allocation
  of the same node (the exclusion constraint), so such a (node, slot) changes by +1 / -1 directly;
- a (node, slot) that any old or new row of the statement covers only partly (an off-grid
  boundary: maintenance windows, node replacements cut at "now") is decided by counting:
  delta = [after > 0] - [before > 0], after = active allocations of the node touching the slot
  now, before = after - rows added + rows removed. Two transactions adding adjacent off-grid
  allocations on one node would each miss the other's uncommitted row, so this path first
  takes a transaction advisory lock on the node (READ COMMITTED: the count after the lock sees
  the other's commit);
- only nodes whose state is 'available' count, in their current pool.

Locks, so that concurrent writers each see what the other committed:
- an allocation write locks its nodes FOR SHARE (conflicts with the UPDATE of a node's state or
  pool, whose trigger then counts the node's allocations) and their pools FOR KEY SHARE
  (conflicts only with FOR UPDATE: a slot-length change or a rebuild, which recomputes the pool);
- node writes lock their pools FOR KEY SHARE; the rebuild locks its pool FOR UPDATE;
- the summary tables have no database foreign keys, so compaction and the deltas' commit take no
  lock on the pool row (bookings already hold it FOR NO KEY UPDATE through the quota query);
- compaction takes disjoint delta batches (SKIP LOCKED) and upserts in (pool, slot) order.
The counts assume READ COMMITTED (Django's default): each statement of a trigger sees what was
committed before its locks were granted.

Advisory lock key: (72001, node id) — provisioning's keys are 71001-71004 (provisioning/constants.py).
"""

import django.db.models.deletion
from django.db import migrations, models


# Advisory-lock namespace for "off-grid usage check of node N" (see the module docstring).
LOCK_SLOT_USAGE_NODE = 72_001

# The slot arithmetic every function shares: slot number k of an instant = floor(epoch / s),
# an allocation [lo, hi) touches slots k0 .. k1 - 1, and covers its first / last one only partly
# when lo / hi is off the grid. extract(epoch ...) is numeric: exact to the microsecond.
SLOTS = """
    floor(extract(epoch FROM {lo}) / {s})::bigint AS k0,
    ceil(extract(epoch FROM {hi}) / {s})::bigint AS k1,
    mod(extract(epoch FROM {lo}), {s}) <> 0 AS lo_off,
    mod(extract(epoch FROM {hi}), {s}) <> 0 AS hi_off"""

# Active allocation versions the statement removed (-1) or added (+1); a row whose node, period
# and active flag did not change (a note, a reservation id) is left out on both sides.
ALLOC_OLD = """
    SELECT o.node_id, lower(o.period) AS lo, upper(o.period) AS hi, -1 AS sign FROM old_rows o
    WHERE o.active {unchanged_new}"""
ALLOC_NEW = """
    SELECT nw.node_id, lower(nw.period) AS lo, upper(nw.period) AS hi, 1 AS sign FROM new_rows nw
    WHERE nw.active {unchanged_old}"""
ALLOC_UNCHANGED_NEW = ("AND NOT EXISTS (SELECT 1 FROM new_rows nw WHERE nw.id = o.id AND nw.node_id = o.node_id "
                       "AND nw.period = o.period AND nw.active)")
ALLOC_UNCHANGED_OLD = ("AND NOT EXISTS (SELECT 1 FROM old_rows o WHERE o.id = nw.id AND o.node_id = nw.node_id "
                       "AND o.period = nw.period AND o.active)")
ALLOC_CHANGES = {
    "insert": ALLOC_NEW.format(unchanged_old=""),
    "delete": ALLOC_OLD.format(unchanged_new=""),
    "update": ALLOC_OLD.format(unchanged_new=ALLOC_UNCHANGED_NEW) + "\n    UNION ALL"
              + ALLOC_NEW.format(unchanged_old=ALLOC_UNCHANGED_OLD),
}

ALLOC_FUNCTION = """
CREATE FUNCTION reservations_slot_usage_alloc_{op}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    -- Hold the nodes against a concurrent state change or pool move (an UPDATE of the node row),
    -- then their pools against a slot-length change or rebuild (FOR UPDATE of the pool row), each
    -- in id order. Nothing to do when no active allocation changed.
    PERFORM 1 FROM reservations_node WHERE id IN (SELECT node_id FROM ({changes}) c) ORDER BY id FOR SHARE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM reservations_pool
    WHERE id IN (SELECT pool_id FROM reservations_node WHERE id IN (SELECT node_id FROM ({changes}) c))
    ORDER BY id FOR KEY SHARE;
    -- Off-grid rows are counted below; serialise such counts per node (see migration 0006).
    PERFORM pg_advisory_xact_lock({lock}, (x.node_id & 2147483647)::int)
    FROM (
        SELECT DISTINCT c.node_id
        FROM ({changes}) c JOIN reservations_node n ON n.id = c.node_id JOIN reservations_pool p ON p.id = n.pool_id
        WHERE n.state = 'available'
          AND (mod(extract(epoch FROM c.lo), p.slot_minutes * 60) <> 0
               OR mod(extract(epoch FROM c.hi), p.slot_minutes * 60) <> 0)
        ORDER BY c.node_id
    ) x;
    INSERT INTO reservations_poolslotusagedelta (pool_id, slot, delta)
    WITH r0 AS (
        SELECT c.node_id, n.pool_id, p.slot_minutes * 60 AS s, c.sign, {slots}
        FROM ({changes}) c JOIN reservations_node n ON n.id = c.node_id JOIN reservations_pool p ON p.id = n.pool_id
        WHERE n.state = 'available'
    ), r AS (
        SELECT r0.*, bool_or(lo_off OR hi_off) OVER (PARTITION BY node_id) AS node_off FROM r0
    ), whole AS (
        -- Nodes whose changed rows all sit on the grid cover every slot they touch whole: count the
        -- rows per period first (a reservation's nodes share one), then spread over the slots.
        SELECT pool_id, s, g.k, sum(c) AS delta
        FROM (SELECT pool_id, s, k0, k1, sum(sign) AS c FROM r WHERE NOT node_off GROUP BY pool_id, s, k0, k1) x
        CROSS JOIN LATERAL generate_series(x.k0, x.k1 - 1) AS g(k)
        GROUP BY pool_id, s, g.k
    ), pair AS (
        -- Other nodes, per (node, slot): net active rows the statement added, and whether any of
        -- them covers the slot only partly.
        SELECT r.node_id, r.pool_id, r.s, g.k, sum(r.sign) AS net,
               bool_or((g.k = r.k0 AND r.lo_off) OR (g.k = r.k1 - 1 AND r.hi_off)) AS partial
        FROM r CROSS JOIN LATERAL generate_series(r.k0, r.k1 - 1) AS g(k)
        WHERE r.node_off
        GROUP BY r.node_id, r.pool_id, r.s, g.k
    ), counted AS (
        SELECT pair.*, (
            SELECT count(*) FROM reservations_allocation a
            WHERE a.node_id = pair.node_id AND a.active
              AND a.period && tstzrange(to_timestamp(pair.k * pair.s), to_timestamp((pair.k + 1) * pair.s))
              AND lower(a.period) < to_timestamp((pair.k + 1) * pair.s) AND upper(a.period) > to_timestamp(pair.k * pair.s)
        ) AS touching
        FROM pair WHERE pair.partial
    ), d AS (
        SELECT pool_id, s, k, delta FROM whole
        UNION ALL
        SELECT pool_id, s, k, net FROM pair WHERE NOT partial AND net <> 0
        UNION ALL
        SELECT pool_id, s, k, (touching > 0)::int - (touching - net > 0)::int FROM counted
    )
    SELECT pool_id, to_timestamp(k * s), sum(delta) FROM d
    GROUP BY pool_id, s, k HAVING sum(delta) <> 0
    ORDER BY pool_id, k;
    RETURN NULL;
END
$fn$;
"""

# Node versions that stopped (-1) or started (+1) counting for a pool: available, in that pool.
NODE_OLD = """
    SELECT o.id, o.pool_id, -1 AS sign FROM old_rows o
    WHERE o.state = 'available' {unchanged_new}"""
NODE_NEW = """
    SELECT nw.id, nw.pool_id, 1 AS sign FROM new_rows nw
    WHERE nw.state = 'available' {unchanged_old}"""
NODE_UNCHANGED_NEW = ("AND NOT EXISTS (SELECT 1 FROM new_rows nw WHERE nw.id = o.id AND nw.pool_id = o.pool_id "
                      "AND nw.state = 'available')")
NODE_UNCHANGED_OLD = ("AND NOT EXISTS (SELECT 1 FROM old_rows o WHERE o.id = nw.id AND o.pool_id = nw.pool_id "
                      "AND o.state = 'available')")
NODE_CHANGES = {
    "insert": NODE_NEW.format(unchanged_old=""),
    "delete": NODE_OLD.format(unchanged_new=""),
    "update": NODE_OLD.format(unchanged_new=NODE_UNCHANGED_NEW) + "\n    UNION ALL"
              + NODE_NEW.format(unchanged_old=NODE_UNCHANGED_OLD),
}

NODE_FUNCTION = """
CREATE FUNCTION reservations_slot_usage_node_{op}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    -- The node rows are ours (this statement changed them); hold their pools against a
    -- concurrent slot-length change or rebuild, in id order.
    PERFORM 1 FROM reservations_pool WHERE id IN (SELECT pool_id FROM ({changes}) c) ORDER BY id FOR KEY SHARE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- A node counts once in each distinct slot its active allocations touch.
    INSERT INTO reservations_poolslotusagedelta (pool_id, slot, delta)
    WITH r AS (
        SELECT DISTINCT c.id, c.pool_id, c.sign, p.slot_minutes * 60 AS s, g.k
        FROM ({changes}) c
        JOIN reservations_pool p ON p.id = c.pool_id
        JOIN reservations_allocation a ON a.node_id = c.id AND a.active
        CROSS JOIN LATERAL (SELECT {slots}) b
        CROSS JOIN LATERAL generate_series(b.k0, b.k1 - 1) AS g(k)
    )
    SELECT pool_id, to_timestamp(k * s), sum(sign) FROM r
    GROUP BY pool_id, s, k HAVING sum(sign) <> 0
    ORDER BY pool_id, k;
    RETURN NULL;
END
$fn$;
"""

REBUILD_FUNCTION = """
CREATE FUNCTION reservations_slot_usage_rebuild(p_pool bigint) RETURNS bigint LANGUAGE plpgsql AS $fn$
DECLARE
    slot_s integer;
    written bigint;
BEGIN
    -- Every writer of this pool's deltas holds the pool row FOR KEY SHARE until it commits: once
    -- we hold it FOR UPDATE, each statement below sees all of their rows and deltas, and no new
    -- one can start before we commit.
    SELECT slot_minutes * 60 INTO slot_s FROM reservations_pool WHERE id = p_pool FOR UPDATE;
    DELETE FROM reservations_poolslotusagedelta WHERE pool_id = p_pool;
    DELETE FROM reservations_poolslotusage WHERE pool_id = p_pool;
    IF slot_s IS NULL THEN
        RETURN 0;
    END IF;
    -- A sweep: +1 at each allocation's first slot, -1 after its last, a running sum. That counts
    -- allocations touching a slot; a node touched twice in one slot (possible only where both
    -- allocations cover the slot partly: an off-grid boundary) is then taken off once per extra touch.
    INSERT INTO reservations_poolslotusage (pool_id, slot, busy)
    WITH a AS (
        SELECT a.id, a.node_id, {slots}
        FROM reservations_allocation a JOIN reservations_node n ON n.id = a.node_id
        WHERE n.pool_id = p_pool AND n.state = 'available' AND a.active
    ), part AS (
        SELECT id, node_id, k0 AS k FROM a WHERE lo_off
        UNION  -- an allocation inside one slot touches it once
        SELECT id, node_id, k1 - 1 FROM a WHERE hi_off
    ), extra AS (
        SELECT k, count(*) - 1 AS c FROM part GROUP BY node_id, k HAVING count(*) > 1
    ), ev AS (
        SELECT k0 AS k, count(*) AS d FROM a GROUP BY k0
        UNION ALL SELECT k1, -count(*) FROM a GROUP BY k1
        UNION ALL SELECT k, -c FROM extra
        UNION ALL SELECT k + 1, c FROM extra
    ), agg AS (
        SELECT k, sum(d) AS d FROM ev GROUP BY k
    ), run AS (
        SELECT k, lead(k) OVER w AS next_k, sum(d) OVER w AS busy FROM agg WINDOW w AS (ORDER BY k)
    )
    SELECT p_pool, to_timestamp(g.k * slot_s), run.busy
    FROM run CROSS JOIN LATERAL generate_series(run.k, run.next_k - 1) AS g(k)
    WHERE run.busy <> 0
    ORDER BY g.k;
    GET DIAGNOSTICS written = ROW_COUNT;
    RETURN written;
END
$fn$;
"""

COMPACT_FUNCTION = """
CREATE FUNCTION reservations_slot_usage_compact(p_limit integer DEFAULT 50000) RETURNS bigint LANGUAGE sql AS $fn$
    -- Move up to p_limit pending deltas into the per-slot rows in one statement: readers see the
    -- deltas or their sum, never both. SKIP LOCKED lets concurrent compactions take disjoint
    -- batches, and upserting in (pool, slot) order means they cannot deadlock on the usage rows.
    WITH batch AS (
        SELECT id FROM reservations_poolslotusagedelta ORDER BY id LIMIT p_limit FOR UPDATE SKIP LOCKED
    ), moved AS (
        DELETE FROM reservations_poolslotusagedelta d USING batch WHERE d.id = batch.id
        RETURNING d.pool_id, d.slot, d.delta
    ), folded AS (
        INSERT INTO reservations_poolslotusage AS u (pool_id, slot, busy)
        SELECT pool_id, slot, sum(delta) FROM moved GROUP BY pool_id, slot ORDER BY pool_id, slot
        ON CONFLICT (pool_id, slot) DO UPDATE SET busy = u.busy + excluded.busy
        RETURNING 1
    )
    SELECT count(*) FROM moved;
$fn$;
"""

TRUNCATE_FUNCTION = """
CREATE FUNCTION reservations_slot_usage_truncated() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    DELETE FROM reservations_poolslotusagedelta;
    DELETE FROM reservations_poolslotusage;
    RETURN NULL;
END
$fn$;
"""

POOL_FUNCTION = """
CREATE FUNCTION reservations_slot_usage_pool_resized() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM reservations_slot_usage_rebuild(NEW.id);
    RETURN NULL;
END
$fn$;
"""

TRANSITIONS = {"insert": "NEW TABLE AS new_rows", "delete": "OLD TABLE AS old_rows",
               "update": "OLD TABLE AS old_rows NEW TABLE AS new_rows"}


def _trigger_sql() -> list[str]:
    sql = []
    for op in ("insert", "update", "delete"):
        sql.append(ALLOC_FUNCTION.format(
            op=op, changes=ALLOC_CHANGES[op], lock=LOCK_SLOT_USAGE_NODE,
            slots=SLOTS.format(lo="c.lo", hi="c.hi", s="(p.slot_minutes * 60)")))
        sql.append(f"CREATE TRIGGER reservations_slot_usage_{op} AFTER {op.upper()} ON reservations_allocation "
                   f"REFERENCING {TRANSITIONS[op]} FOR EACH STATEMENT "
                   f"EXECUTE FUNCTION reservations_slot_usage_alloc_{op}()")
        sql.append(NODE_FUNCTION.format(
            op=op, changes=NODE_CHANGES[op],
            slots=SLOTS.format(lo="lower(a.period)", hi="upper(a.period)", s="(p.slot_minutes * 60)")))
        sql.append(f"CREATE TRIGGER reservations_slot_usage_{op} AFTER {op.upper()} ON reservations_node "
                   f"REFERENCING {TRANSITIONS[op]} FOR EACH STATEMENT "
                   f"EXECUTE FUNCTION reservations_slot_usage_node_{op}()")
    sql += [
        REBUILD_FUNCTION.format(slots=SLOTS.format(lo="lower(a.period)", hi="upper(a.period)", s="slot_s")),
        COMPACT_FUNCTION,
        TRUNCATE_FUNCTION,
        "CREATE TRIGGER reservations_slot_usage_truncate AFTER TRUNCATE ON reservations_allocation "
        "FOR EACH STATEMENT EXECUTE FUNCTION reservations_slot_usage_truncated()",
        POOL_FUNCTION,
        "CREATE TRIGGER reservations_slot_usage_resize AFTER UPDATE OF slot_minutes ON reservations_pool "
        "FOR EACH ROW WHEN (OLD.slot_minutes IS DISTINCT FROM NEW.slot_minutes) "
        "EXECUTE FUNCTION reservations_slot_usage_pool_resized()",
        # Existing data: build every pool's rows once.
        "SELECT reservations_slot_usage_rebuild(id) FROM reservations_pool ORDER BY id",
    ]
    return sql


def _reverse_sql() -> list[str]:
    sql = []
    for op in ("insert", "update", "delete"):
        sql.append(f"DROP TRIGGER IF EXISTS reservations_slot_usage_{op} ON reservations_allocation")
        sql.append(f"DROP TRIGGER IF EXISTS reservations_slot_usage_{op} ON reservations_node")
        sql.append(f"DROP FUNCTION IF EXISTS reservations_slot_usage_alloc_{op}()")
        sql.append(f"DROP FUNCTION IF EXISTS reservations_slot_usage_node_{op}()")
    return sql + [
        "DROP TRIGGER IF EXISTS reservations_slot_usage_truncate ON reservations_allocation",
        "DROP TRIGGER IF EXISTS reservations_slot_usage_resize ON reservations_pool",
        "DROP FUNCTION IF EXISTS reservations_slot_usage_truncated()",
        "DROP FUNCTION IF EXISTS reservations_slot_usage_pool_resized()",
        "DROP FUNCTION IF EXISTS reservations_slot_usage_compact(integer)",
        "DROP FUNCTION IF EXISTS reservations_slot_usage_rebuild(bigint)",
    ]


class Migration(migrations.Migration):

    dependencies = [
        ('reservations', '0005_allocation_period_covering_gist'),
    ]

    operations = [
        migrations.CreateModel(
            name='PoolSlotUsage',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('slot', models.DateTimeField(help_text="Start of the slot on the pool's UTC-epoch grid.")),
                ('busy', models.IntegerField(default=0)),
                ('pool', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='reservations.pool')),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('pool', 'slot'), name='reservations_poolslotusage_unique_pool_slot', violation_error_message='One usage row per pool and slot.')],
            },
        ),
        migrations.CreateModel(
            name='PoolSlotUsageDelta',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('slot', models.DateTimeField()),
                ('delta', models.IntegerField()),
                ('pool', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='reservations.pool')),
            ],
            options={
                'indexes': [models.Index(fields=['pool', 'slot'], name='reservations_usagedelta_slot')],
            },
        ),
        migrations.RunSQL(sql=_trigger_sql(), reverse_sql=_reverse_sql()),
    ]
