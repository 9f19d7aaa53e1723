"""Broker queue names of the node agents, in plain Python.

The agent's launcher (``python -m provisioning.health.worker node``) names its queue before it picks its settings
module; importing anything of the portal package first would load the Celery app, which picks production's settings
(and then the agent asks for SECRET_KEY, which a GPU node handed to tenants must not hold).
"""

from __future__ import annotations


def node_queue(hostname: str) -> str:
    """A node agent's own queue. Hostnames are one host ignoring case (as node_create compares them), broker
    queue names are not: both ends name it in lower case, so an agent started as H100-001 (its socket name, or
    --hostname) serves the checks the portal sends node h100-001, and the other way round."""
    return f"node.{hostname.lower()}"
