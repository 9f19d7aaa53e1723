"""Local development and `make run`: debug on, a fixed throwaway secret."""

from .base import *  # noqa: F403
from .base import env, env_list

DEBUG = env.bool("DEBUG", default=True)
SECRET_KEY = env("SECRET_KEY", default="dev-only-insecure-secret-key-change-me")  # noqa: S105
PORTAL_FERNET_KEYS = env_list("PORTAL_FERNET_KEYS", default=["ZGV2LW9ubHktZmVybmV0LWtleS0zMi1ieXRlcyEhISE="])

# Clusters are handed over only when their nodes pass the medium GPU checks (provisioning/health).
PORTAL_ACCEPTANCE_GATE = env("PORTAL_ACCEPTANCE_GATE", default="provisioning.health.services.health_acceptance_gate")

# `make run`'s demo webhook receiver listens on loopback.
PORTAL_WEBHOOK_ALLOW_PRIVATE = env.bool("PORTAL_WEBHOOK_ALLOW_PRIVATE", default=True)
