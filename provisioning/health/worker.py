"""Start a health worker: the simulated fleet, or the agent of one real GPU node.

    python -m provisioning.health.worker fleet [-c 2] [-l info]
        Serves the ``fleet`` queue (PORTAL_HEALTH_FLEET_QUEUE): every simulated node's checks,
        with FakeNvml and the faults of PORTAL_FAKE_NVML (JSON, or @file re-read on change).
        Pair it with PORTAL_HEALTH_AGENT_QUEUE=fleet on the portal (the default).

    python -m provisioning.health.worker node [--hostname NAME] [-l info]
        On a GPU node: serves ``node.<hostname in lower case>`` (and ``node.<hostname>`` as given, when
        it has capitals: the queue before names went to lower case) with pynvml, one check at a time, and posts
        reports back to the ``health`` queue. Needs only the broker (CELERY_BROKER_URL /
        REDIS_URL), no database. Set PORTAL_HEALTH_AGENT_QUEUE=node on the portal.

Both run ``celery -A portal worker`` with the right queue; extra arguments pass through. The fleet worker,
like any worker of the deployment, runs ``portal.settings.production`` unless DJANGO_SETTINGS_MODULE says
otherwise, so it needs SECRET_KEY and PORTAL_FERNET_KEYS (docs/settings.md). The node agent runs
``portal.settings.node_agent`` unless told otherwise: the broker URL and none of the portal's secrets (a
node is handed to tenants; the agent signs and decrypts nothing).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence

from provisioning.health.queues import node_queue  # plain Python: no settings picked before main's

NODE_AGENT_SETTINGS = "portal.settings.node_agent"


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m provisioning.health.worker", description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("fleet", "node"))
    parser.add_argument("-c", "--concurrency", type=int, default=None)
    parser.add_argument("-l", "--loglevel", default="info")
    parser.add_argument("--hostname", default=None, help="the node's name as the portal knows it (node mode)")
    return parser.parse_known_args(argv)


def build_argv(argv: Sequence[str] | None = None) -> list[str]:
    """Return the celery command line for the arguments."""
    args, extra = _parse(argv)
    if args.mode == "fleet":
        queue = os.environ.get("PORTAL_HEALTH_FLEET_QUEUE", "fleet")
        concurrency = args.concurrency or os.cpu_count() or 1
        name = f"health-fleet@{socket.gethostname()}"
    else:
        host = args.hostname or socket.gethostname()
        queue = node_queue(host)  # lower case, as the portal names it
        if f"node.{host}" != queue:
            # The queue of the name as given too: an agent served it before queue names went to lower case, and
            # what the portal sent there before the upgrade (or a portal not yet upgraded still sends) would
            # otherwise wait in Redis for ever, unread. A check goes to one queue only: it runs once.
            queue = f"{queue},node.{host}"
        concurrency = args.concurrency or 1  # one check at a time: medium tests own every GPU
        name = f"health-agent@{host}"
    # The agent takes no message it cannot start yet (whatever settings module it runs): one held while an
    # hour-long check runs would go back on the queue at the broker's visibility timeout and run twice.
    prefetch = ["--disable-prefetch"] if args.mode == "node" else []
    return [
        sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queue, "-c", str(concurrency),
        "-n", name, "-l", args.loglevel, "--without-gossip", "--without-mingle", *prefetch, *extra,
    ]


def main(argv: Sequence[str] | None = None) -> None:
    # A settings module given is kept. Unset, the fleet worker is left to the Celery app, which picks production
    # (portal/celery.py) as for every other worker and server of a deployment, and the node agent gets its own
    # (DEBUG off, the broker required, no SECRET_KEY or Fernet keys); dev's DEBUG and fixed keys only when asked for.
    command = build_argv(argv)
    if _parse(argv)[0].mode == "node":
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", NODE_AGENT_SETTINGS)
    os.execv(command[0], command)  # noqa: S606 - our own interpreter, arguments built above


if __name__ == "__main__":
    main()
