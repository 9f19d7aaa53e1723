"""Recompute the per-slot availability summary from the allocations (repair), and report drift.

    python manage.py rebuild_slot_usage [--pool NAME] [--check]

The triggers of migration 0006 keep the summary exact on every write; this is the tool for a
database restored or edited with the triggers off. --check only compares and exits 1 on drift.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from portal.core.cli import storable_text
from portal.core.words import count_of
from reservations.models import Pool
from reservations.services import slot_usage_compact, slot_usage_rebuild

# busy + pending deltas per (pool, slot), zero slots left out.
SUMMARY_SQL = """
    SELECT pool_id, slot, sum(busy) FROM (
        SELECT pool_id, slot, busy FROM reservations_poolslotusage WHERE pool_id = ANY(%(pools)s)
        UNION ALL
        SELECT pool_id, slot, delta FROM reservations_poolslotusagedelta WHERE pool_id = ANY(%(pools)s)
    ) x GROUP BY pool_id, slot HAVING sum(busy) <> 0
"""


class Command(BaseCommand):
    help = "Recompute the per-slot availability summary of every pool (or one) from the allocations."

    def add_arguments(self, parser):
        parser.add_argument("--pool", help="Pool name; default: every pool.")
        parser.add_argument("--check", action="store_true", help="Compare only; exit 1 if the summary drifted.")

    def handle(self, *args, **o):
        pools = Pool.objects.order_by("id")
        if o["pool"]:
            pools = pools.filter(name=storable_text(o["pool"], what="--pool"))
            if not pools.exists():
                raise CommandError(f"No pool named {o['pool']!r}.")
        pool_ids = list(pools.values_list("id", flat=True))
        if o["check"]:
            drift = self._drift(pool_ids)
            for pool_id, slot, summary, actual in drift[:20]:
                self.stdout.write(f"pool {pool_id} slot {slot:%Y-%m-%dT%H:%M:%SZ}: summary {summary}, actual {actual}")
            if drift:
                raise CommandError(f"{count_of(len(drift), 'slot')} drifted; run without --check to rebuild.")
            self.stdout.write(f"rebuild_slot_usage: no drift in {count_of(len(pool_ids), 'pool')}")
            return
        with transaction.atomic():
            written = {}
            for pool_id in pool_ids:
                written.update(slot_usage_rebuild(pool_id=pool_id))
        moved = slot_usage_compact()
        self.stdout.write(f"rebuild_slot_usage: {count_of(sum(written.values()), 'slot row')} in "
                          f"{count_of(len(written), 'pool')}, {count_of(moved, 'pending delta')} compacted since")

    def _drift(self, pool_ids: list[int]) -> list[tuple]:
        """Return (pool id, slot, summary, rebuilt) where they differ; the rebuild is rolled back."""
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(SUMMARY_SQL, {"pools": pool_ids})
            before = {(p, slot): busy for p, slot, busy in cur.fetchall()}
            sid = transaction.savepoint()
            for pool_id in pool_ids:
                slot_usage_rebuild(pool_id=pool_id)
            cur.execute(SUMMARY_SQL, {"pools": pool_ids})
            after = {(p, slot): busy for p, slot, busy in cur.fetchall()}
            transaction.savepoint_rollback(sid)
        return sorted((p, slot, before.get((p, slot), 0), after.get((p, slot), 0))
                      for p, slot in before.keys() | after.keys() if before.get((p, slot)) != after.get((p, slot)))
