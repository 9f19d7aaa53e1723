"""Bulk-load a fleet at scale for benchmarks: nodes, tenants, reservations and allocations via COPY.

    python manage.py seed_scale --nodes 10000 --allocations 1000000

Meant for a database of its own (bench/availability.py creates ``portal_scale``). Everything it
creates is named ``scale-…``; ``--replace`` deletes an earlier scale load first.

Shape of the data: nodes sit in racks of 8; each rack runs a sequence of bookings from
``--days-back`` before now onwards. Each step splits the rack into reservations of 1-8 nodes
that share one period (4 h to a week), followed by an idle gap; a few steps are a maintenance
window on one node, a few reservations are cancelled (inactive allocations). Statuses follow
the clock (completed / active / confirmed). Every active allocation still passes the exclusion
constraint: the constraint is re-created after the load and validates all rows, so a generator
bug cannot produce a double booking.

The availability summary (migration 0006) is not fed row by row: its triggers on nodes and
allocations are disabled for the load, and each new pool's per-slot rows are rebuilt once at the
end, in the same transaction (a sweep over the pool's allocations), then pending deltas compacted.

Speed: the secondary indexes, the exclusion constraint and the foreign keys of the two big
tables are dropped for the COPY and re-created from their own definitions afterwards (one
bulk build each instead of a million index insertions and deferred FK checks), all in one
transaction.
"""

from __future__ import annotations

import io
import json
import random
import time
from datetime import UTC, datetime

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from django.utils import timezone

from portal.core.words import count_of
from reservations.choices import AllocationKind, Billing, NodeState, Orchestrator, ReservationStatus
from reservations.models import Allocation, Node, Pool, PoolSlotUsage, PoolSlotUsageDelta, Reservation
from reservations.services import slot_usage_compact, slot_usage_rebuild
from tenants.models import Quota, Tenant

PREFIX = "scale-"
RACK = 8
# Booking lengths in hours and how often each occurs; gaps between bookings of a rack.
DURATIONS = [(4, 10), (8, 20), (12, 15), (24, 25), (48, 15), (72, 10), (168, 5)]
RACK_SPLITS = [[8], [8], [4, 4], [2, 2, 4], [1, 1, 2, 4], [2, 2, 2, 2], [1, 1, 1, 1, 4]]
NODE_STATES = [(NodeState.AVAILABLE, 960), (NodeState.DRAINING, 10), (NodeState.MAINTENANCE, 10),
               (NodeState.FAILED, 10), (NodeState.RETIRED, 10)]
BIG_TABLES = ("reservations_allocation", "reservations_reservation")
# --days-back: at least a day of history, at most ten years of it.
MAX_DAYS_BACK = 3650


def _weighted(rng: random.Random, table: list[tuple]) -> object:
    return rng.choices([v for v, _ in table], weights=[w for _, w in table])[0]


class _Timestamps:
    """COPY text for hour-aligned instants, cached (a million rows share a few thousand hours)."""

    def __init__(self) -> None:
        self._cache: dict[int, str] = {}

    def __call__(self, epoch_hour: int) -> str:
        text = self._cache.get(epoch_hour)
        if text is None:
            text = datetime.fromtimestamp(epoch_hour * 3600, UTC).strftime("%Y-%m-%d %H:%M:%S+00")
            self._cache[epoch_hour] = text
        return text


class Command(BaseCommand):
    help = "Bulk-load scale data (COPY): --nodes N --allocations M, for benchmarks on a database of its own."

    def add_arguments(self, parser):
        parser.add_argument("--nodes", type=int, default=10_000)
        parser.add_argument("--allocations", type=int, default=1_000_000)
        parser.add_argument("--pools", type=int, default=1, help="Split the nodes evenly over this many pools.")
        parser.add_argument("--tenants", type=int, default=40)
        parser.add_argument("--days-back", type=int, default=60,
                            help=f"History starts this many days ago (1 to {MAX_DAYS_BACK}).")
        parser.add_argument("--seed", type=int, default=42)
        parser.add_argument("--replace", action="store_true", help="Delete an earlier scale load first.")
        parser.add_argument("--no-vacuum", action="store_true", help="Skip VACUUM ANALYZE after the load.")

    def handle(self, *args, **o):
        if o["nodes"] < 1 or o["allocations"] < 0 or o["pools"] < 1 or o["tenants"] < 1:
            raise CommandError("--nodes, --pools and --tenants must be positive, --allocations not negative.")
        if o["pools"] > o["nodes"]:
            raise CommandError("More pools than nodes.")
        if not 1 <= o["days_back"] <= MAX_DAYS_BACK:
            raise CommandError(f"--days-back must be between 1 and {MAX_DAYS_BACK} days (got {o['days_back']}): "
                               "the history the load starts with, before now.")
        started = time.monotonic()
        rng = random.Random(o["seed"])
        with transaction.atomic():
            loaded = Pool.objects.filter(name__startswith=PREFIX).exists()
            if loaded and not o["replace"]:
                raise CommandError("Scale data is already loaded; pass --replace to load it again.")
            with _without_slot_usage_triggers():
                if loaded:
                    self._delete_previous()
                pools, tenants = self._fleet_frame(o)
                node_rows = self._copy_nodes(pools, o["nodes"], rng)
                with _without_secondary_structures(BIG_TABLES):
                    reservations, allocations = self._copy_bookings(node_rows, pools, tenants, o, rng)
                with connection.cursor() as cur:
                    for table in ("reservations_node", *BIG_TABLES):
                        cur.execute(f"ANALYZE {table}")
            # The load bypassed the availability summary's triggers: build the new pools' rows once.
            for pool in pools:
                slot_usage_rebuild(pool_id=pool.pk)
        slot_usage_compact()
        if not o["no_vacuum"] and not connection.in_atomic_block:
            # Sets the visibility map so the planner can use index-only scans; not allowed in a transaction.
            with connection.cursor() as cur:
                for table in ("reservations_node", *BIG_TABLES, "reservations_poolslotusage"):
                    cur.execute(f"VACUUM ANALYZE {table}")
        self.stdout.write(
            f"seed_scale: {count_of(len(node_rows), 'node')} in {count_of(len(pools), 'pool')}, "
            f"{count_of(len(tenants), 'tenant')}, {count_of(reservations, 'reservation')}, "
            f"{count_of(allocations, 'allocation')} in {time.monotonic() - started:.1f} s"
        )

    # --- steps ------------------------------------------------------------------------------

    def _delete_previous(self) -> None:
        pool_ids = list(Pool.objects.filter(name__startswith=PREFIX).values_list("id", flat=True))
        with connection.cursor() as cur:
            cur.execute("DELETE FROM reservations_allocation a USING reservations_node n "
                        "WHERE n.id = a.node_id AND n.pool_id = ANY(%s)", [pool_ids])
            cur.execute("DELETE FROM reservations_reservation WHERE pool_id = ANY(%s)", [pool_ids])
        PoolSlotUsageDelta.objects.filter(pool_id__in=pool_ids).delete()
        PoolSlotUsage.objects.filter(pool_id__in=pool_ids).delete()
        Quota.objects.filter(pool_id__in=pool_ids).delete()
        Node.objects.filter(pool_id__in=pool_ids).delete()
        Pool.objects.filter(id__in=pool_ids).delete()
        Tenant.objects.filter(slug__startswith=PREFIX).delete()

    def _fleet_frame(self, o) -> tuple[list[Pool], list[Tenant]]:
        pools = [
            Pool.objects.create(name=f"{PREFIX}p{i}", gpu_model="H100-SXM", gpus_per_node=8, on_demand_rate="4.50")
            for i in range(o["pools"])
        ]
        Tenant.objects.bulk_create(
            [Tenant(slug=f"{PREFIX}t{i:03d}", name=f"Scale tenant {i}", burst_enabled=i % 2 == 0)
             for i in range(o["tenants"])]
        )
        tenants = list(Tenant.objects.filter(slug__startswith=PREFIX).order_by("slug"))
        Quota.objects.bulk_create([
            Quota(tenant=t, pool=p, max_nodes=o["nodes"], burst_nodes=o["nodes"] // 10)
            for t in tenants for p in pools
        ])
        return pools, tenants

    def _copy_nodes(self, pools: list[Pool], count: int, rng: random.Random) -> list[tuple[int, int, str]]:
        """COPY the nodes; return (id, pool id, state) for each."""
        base = _next_id("reservations_node")
        now = _ts_now()
        columns, extra = _columns(Node, ["id", "hostname", "pool_id", "state", "state_reason", "gpus", "created_at",
                                         "updated_at"])
        rows, buf = [], io.StringIO()
        per_pool = -(-count // len(pools))
        for i in range(count):
            pool = pools[min(i // per_pool, len(pools) - 1)]
            state = _weighted(rng, NODE_STATES)
            node_id = base + i
            rows.append((node_id, pool.pk, state))
            buf.write(f"{node_id}\t{pool.name}-{i:05d}\t{pool.pk}\t{state}\t\t[]\t{now}\t{now}{extra}\n")
        with connection.cursor() as cur:
            _copy(cur, "reservations_node", columns, buf)
            _sync_sequence(cur, "reservations_node")
        return rows

    def _copy_bookings(self, node_rows, pools, tenants, o, rng: random.Random) -> tuple[int, int]:
        """Generate rack timelines and COPY reservations and allocations; return both counts."""
        now_hour = int(timezone.now().timestamp()) // 3600
        first_hour = now_hour - o["days_back"] * 24
        ts = _Timestamps()
        created = _ts_now()
        racks = [node_rows[i:i + RACK] for i in range(0, len(node_rows), RACK)]
        # Keep each rack within one pool (the last rack of a pool may be short).
        racks = [r for rack in racks for r in _split_by_pool(rack)]
        budget = o["allocations"]
        per_rack = [budget // len(racks) + (1 if i < budget % len(racks) else 0) for i in range(len(racks))]
        res_id = _next_id("reservations_reservation")
        alloc_id = _next_id("reservations_allocation")
        res_buf, alloc_buf = io.StringIO(), io.StringIO()
        res_columns, res_extra = _columns(Reservation, [
            "id", "tenant_id", "pool_id", "node_count", "period", "name", "status", "status_reason", "billing",
            "orchestrator", "cuda_version", "created_by_id", "created_at", "updated_at", "on_demand_rate",
            "gpus_per_node", "burst_part_nodes"])
        billed_at = {pool.pk: f"{pool.on_demand_rate}\t{pool.gpus_per_node}" for pool in pools}  # as booked now
        alloc_columns, alloc_extra = _columns(Allocation, [
            "id", "reservation_id", "node_id", "period", "kind", "active", "note", "created_by_id", "created_at"])
        n_res = 0
        billing = (Billing.COMMITTED,) * 4 + (Billing.BURST,)
        orchestrators = (Orchestrator.SLURM, Orchestrator.SLURM, Orchestrator.KUBERNETES)
        for rack, quota in zip(racks, per_rack, strict=True):
            hour = first_hour + rng.randrange(0, 24)
            left = quota
            while left > 0:
                hours = _weighted(rng, DURATIONS)
                lo, hi = hour, hour + hours
                period = f'["{ts(lo)}","{ts(hi)}")'
                if rng.random() < 0.005:
                    node_id = rng.choice(rack)[0]
                    alloc_buf.write(f"{alloc_id}\t\\N\t{node_id}\t{period}\t{AllocationKind.MAINTENANCE}\tt\t"
                                    f"scale maintenance\t\\N\t{created}{alloc_extra}\n")
                    alloc_id += 1
                    left -= 1
                else:
                    split = [n for n in rng.choice(RACK_SPLITS) if n <= len(rack)] or [len(rack)]
                    nodes = list(rack)
                    rng.shuffle(nodes)
                    for size in split:
                        if left <= 0 or not nodes:
                            break
                        size = min(size, left, len(nodes))
                        members, nodes = nodes[:size], nodes[size:]
                        cancelled = rng.random() < 0.03
                        if cancelled:
                            status = ReservationStatus.CANCELLED
                        elif hi <= now_hour:
                            status = ReservationStatus.COMPLETED
                        elif lo <= now_hour:
                            status = ReservationStatus.ACTIVE
                        else:
                            status = ReservationStatus.CONFIRMED
                        tenant = tenants[rng.randrange(len(tenants))]
                        billed = rng.choice(billing)
                        # A burst booking has some of its nodes above the guarantee (usage bills those as burst).
                        burst_part = rng.randint(1, size) if billed == Billing.BURST else 0
                        res_buf.write(
                            f"{res_id}\t{tenant.pk}\t{members[0][1]}\t{size}\t{period}\tscale-{res_id}\t{status}\t\t"
                            f"{billed}\t{rng.choice(orchestrators)}\t12.8\t\\N\t{created}\t{created}\t"
                            f"{billed_at[members[0][1]]}\t{burst_part}{res_extra}\n"
                        )
                        active = "f" if cancelled else "t"
                        for node_id, _, _ in members:
                            alloc_buf.write(f"{alloc_id}\t{res_id}\t{node_id}\t{period}\t"
                                            f"{AllocationKind.RESERVATION}\t{active}\t\t\\N\t{created}{alloc_extra}\n")
                            alloc_id += 1
                        res_id += 1
                        n_res += 1
                        left -= size
                hour = hi + int(rng.expovariate(1 / 18))
        with connection.cursor() as cur:
            _copy(cur, "reservations_reservation", res_columns, res_buf)
            _copy(cur, "reservations_allocation", alloc_columns, alloc_buf)
            _sync_sequence(cur, "reservations_reservation")
            _sync_sequence(cur, "reservations_allocation")
            cur.execute("SELECT count(*) FROM reservations_allocation a JOIN reservations_node n ON n.id = a.node_id "
                        "JOIN reservations_pool p ON p.id = n.pool_id WHERE p.name LIKE %s", [PREFIX + "%"])
            n_alloc = cur.fetchone()[0]
        return n_res, n_alloc


# --- helpers ----------------------------------------------------------------------------


def _split_by_pool(rack):
    out, cur = [], []
    for row in rack:
        if cur and cur[-1][1] != row[1]:
            out.append(cur)
            cur = []
        cur.append(row)
    if cur:
        out.append(cur)
    return out


def _copy_text(value) -> str:
    if value is None:
        return "\\N"
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, dict | list):
        value = json.dumps(value)
    text = str(value)
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _columns(model, known: list[str]) -> tuple[str, str]:
    """Return the COPY column list and the text to append to each row for the model's other columns.

    Columns this command does not know (added by later migrations) get their field default, so the
    load keeps working as the models grow; a required column without a default stops it loudly.
    """
    extra_columns, extra_values = [], []
    for field in model._meta.concrete_fields:
        if field.column in known:
            continue
        if field.has_default():
            value = field.get_default()
        elif field.null:
            value = None
        else:
            raise CommandError(f"seed_scale does not know how to fill {model._meta.db_table}.{field.column}")
        extra_columns.append(field.column)
        extra_values.append(_copy_text(value))
    columns = ", ".join(connection.ops.quote_name(c) for c in [*known, *extra_columns])
    return columns, "".join(f"\t{v}" for v in extra_values)


def _ts_now() -> str:
    return timezone.now().astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f+00")


def _next_id(table: str) -> int:
    with connection.cursor() as cur:
        # Keep concurrent writers out while ids are handed out by hand.
        cur.execute(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")
        cur.execute(f"SELECT coalesce(max(id), 0) + 1 FROM {table}")  # noqa: S608 — a constant table name
        return cur.fetchone()[0]


def _sync_sequence(cur, table: str) -> None:
    cur.execute(
        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT coalesce(max(id), 1) FROM {table}))"  # noqa: S608
    )


def _copy(cur, table: str, columns: str, buf: io.StringIO) -> None:
    data = buf.getvalue().encode()
    chunk = 8 << 20
    with cur.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
        for i in range(0, len(data), chunk):
            copy.write(data[i:i + chunk])


SLOT_USAGE_TRIGGERS = [(table, f"reservations_slot_usage_{op}")
                       for table in ("reservations_node", "reservations_allocation")
                       for op in ("insert", "update", "delete")]


class _without_slot_usage_triggers:
    """Disable the availability summary's row triggers for the block (inside the caller's transaction).

    A COPY would otherwise hand a million rows to the statement trigger's transition table; the
    caller rebuilds the summary of what it loaded instead. On an error the transaction rolls back,
    the ALTERs with it.
    """

    def __enter__(self):
        with connection.cursor() as cur:
            for table, trigger in SLOT_USAGE_TRIGGERS:
                cur.execute(f'ALTER TABLE {table} DISABLE TRIGGER "{trigger}"')
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            with connection.cursor() as cur:
                for table, trigger in SLOT_USAGE_TRIGGERS:
                    cur.execute(f'ALTER TABLE {table} ENABLE TRIGGER "{trigger}"')
        return False


class _without_secondary_structures:
    """Drop the tables' secondary indexes, exclusion constraints and foreign keys; re-create them on exit.

    Each is re-created from PostgreSQL's own definition of it (pg_get_indexdef /
    pg_get_constraintdef), so the schema after the load is exactly the migrated one, and the
    re-created exclusion constraint and foreign keys validate every loaded row.
    """

    def __init__(self, tables: tuple[str, ...]) -> None:
        self.tables = tables
        self.constraints: list[tuple[str, str, str]] = []
        self.indexes: list[str] = []

    def __enter__(self):
        with connection.cursor() as cur:
            # Fire the deferred FK checks of rows written so far: ALTER TABLE refuses pending trigger events.
            cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cur.execute(
                """
                SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid), c.contype
                FROM pg_constraint c WHERE c.conrelid = ANY(%s::regclass[]) AND c.contype IN ('f', 'x')
                ORDER BY c.contype DESC
                """,
                [list(self.tables)],
            )
            self.constraints = [(t, name, definition) for t, name, definition, _ in cur.fetchall()]
            cur.execute(
                """
                SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid)
                FROM pg_index i
                WHERE i.indrelid = ANY(%s::regclass[])
                  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)
                """,
                [list(self.tables)],
            )
            named_indexes = cur.fetchall()
            self.indexes = [definition for _, definition in named_indexes]
            for table, name, _ in self.constraints:
                cur.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
            for name, _ in named_indexes:
                cur.execute(f"DROP INDEX {name}")
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            return False  # the surrounding transaction rolls the drops back
        with connection.cursor() as cur:
            cur.execute("SET LOCAL maintenance_work_mem = '512MB'")
            for definition in self.indexes:
                cur.execute(definition)
            # Exclusion constraints first (contype 'x' sorted before 'f'), then foreign keys.
            for table, name, definition in self.constraints:
                cur.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}')
        return False

