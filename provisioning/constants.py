"""PostgreSQL advisory-lock keys of this app, in one place (two-int form: namespace, id).

Session-level locks (pg_try_advisory_lock) are released by PostgreSQL when the holding
connection goes away, so a worker killed with SIGKILL never leaves one behind. The helpers
(`advisory_lock`, `locked_keys`) and the 70_xxx namespace live in portal.core.locks.
"""

# One provisioning/teardown task per cluster at a time: a duplicate delivery (redispatch,
# redelivery after a crash) finds the lock held and returns at once.
LOCK_CLUSTER = 71_001
# One lifecycle tick at a time, however many beat or retried ticks arrive together.
LOCK_TICK = 71_002
# Assigning a tenant's VLAN/CIDR: read-then-write on the tenant row.
LOCK_TENANT_NETWORK = 71_003
# Converging one reservation's booking with the backend (Slurm reservation).
LOCK_BOOKING = 71_004
# Following one node's state into the backends (drain/resume): two node_changed tasks of one node
# run one after the other, so the later one acts on the latest state.
LOCK_NODE_SYNC = 71_005

# Taken inside PostgreSQL, not from Python, and listed here so no key is used twice: the
# availability summary's allocation trigger (reservations migration 0006) serialises changes
# to one node's off-grid allocations with pg_advisory_xact_lock(72001, node id).
LOCK_SLOT_USAGE_NODE = 72_001
# Transaction locks on the nodes a booking is about to insert, in node-id order, so two bookers of
# one node queue instead of deadlocking in the exclusion index (reservations.services).
LOCK_BOOKING_NODE = 72_002
# One node's health consequences at a time (provisioning.health: a session lock held over the drain, the
# repair it opens and the bookings it moves). Its own namespace: it once shared 72001 with the summary's
# off-grid lock above, so a booking moved onto a node under a health step deadlocked with that step.
LOCK_NODE_HEALTH = 72_003
