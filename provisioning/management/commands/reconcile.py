"""`manage.py reconcile [--fix] [--backend NAME]`: find (and repair) drift between the portal and its backends.

Both ways: backend objects of ours the database no longer wants (orphans, deleted with
--fix) and bookings or clusters the backend lacks or holds differently (re-applied with
--fix); node drain states follow the portal's node states. A repair the backend refuses, and a
backend that cannot be read, are reported as unrepaired drift beside everything else. Exit
status 1 when drift was found and not repaired, so a cron job or CI can alert on it. --json prints one JSON
object per drift on stdout and nothing else there (the count goes to stderr).
"""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from django.template.defaultfilters import pluralize

from provisioning.backends.base import BackendError
from provisioning.backends.registry import BACKENDS
from provisioning.services import reconcile


class Command(BaseCommand):
    help = "Compare the provisioning backends with the database; repair drift with --fix."

    def add_arguments(self, parser):
        parser.add_argument("--fix", action="store_true", help="Repair what differs (default: report only).")
        parser.add_argument("--backend", choices=BACKENDS, help="Only this backend (default: the configured ones).")
        parser.add_argument("--json", action="store_true", help="Print the drift as JSON lines.")

    def handle(self, *args, fix: bool = False, backend: str | None = None, json: bool = False, **options):
        try:
            drifts = reconcile(fix=fix, backend_name=backend)
        except BackendError as exc:
            raise CommandError(f"backend unreachable: {exc.message}")
        for drift in drifts:
            if json:
                self.stdout.write(_dumps(drift))
            else:
                state = "repaired" if drift["repaired"] else "found"
                self.stdout.write(f"{drift['backend']}: {drift['kind']} {drift['name']}: {drift['detail']} ({state})")
        unrepaired = [d for d in drifts if not d["repaired"]]
        # With --json stdout carries nothing but the drifts' JSON lines; the summary is for a person.
        summary = f"{len(drifts)} drift{pluralize(len(drifts))}, {len(drifts) - len(unrepaired)} repaired"
        (self.stderr if json else self.stdout).write(summary)
        if unrepaired:
            raise SystemExit(1)


def _dumps(value) -> str:
    return json.dumps(value, sort_keys=True)
