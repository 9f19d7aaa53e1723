"""A small typed client over ``scontrol`` for the portal's Slurm reservations and nodes.

The portal is the privileged broker: only root or ``SlurmUser`` may create reservations,
so the worker that runs this client runs as one of them. Everything goes through the
``scontrol`` command line (no libslurm binding, no slurmrestd) because that is the one
interface present on every Slurm installation; the Debian 12 version (22.05) has no
``--json`` for ``scontrol show``, so we parse ``--oneliner`` output instead.

Time zones: we pass times as ``YYYY-MM-DDTHH:MM:SS`` in UTC and run scontrol with
``TZ=UTC``, so what we write and what scontrol prints back are both UTC whatever the
machine's zone. ``SLURM_TIME_FORMAT=standard`` guards against a caller's environment that
asks for relative or custom time output.

Reservation names are ``<tenant>-<id>`` (see :func:`reservation_name`). The portal names
nodes explicitly (the database chose them), so it never uses ``NodeCnt`` nor Slurm's
``REPLACE``/``REPLACE_DOWN`` flags, which Slurm only allows without an explicit node list;
a failed node is swapped by :meth:`SlurmClient.update_reservation` with a new ``nodes``.
"""

from __future__ import annotations

import enum
import os
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from provisioning.backends import hostlist

__all__ = [
    "EnsureAction",
    "EnsureResult",
    "NodeInfo",
    "NodeNotFound",
    "Partition",
    "PartitionNotFound",
    "Reservation",
    "ReservationAlreadyStarted",
    "ReservationBusy",
    "ReservationExists",
    "ReservationNotFound",
    "ReservationOverlap",
    "SlurmClient",
    "SlurmError",
    "SlurmUnavailable",
    "reservation_name",
    "same_start",
]

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"
# Slurm names (reservations, accounts, users, nodes) are passed as ``Key=value`` argv items;
# a space, ``=`` or ``,`` inside one would be read by scontrol as a different argument.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")  # \Z: "$" would take a trailing newline
_FLAG = re.compile(r"^[A-Z_]+(=[0-9:-]+)?$")
# In ``--oneliner`` output a new field starts with ``Key=``; a token without one continues
# the previous value (free text such as a node's Reason may contain spaces).
_FIELD_START = re.compile(r"^[A-Za-z][A-Za-z0-9_:/]*=")
# A reservation's name runs up to " StartTime=", the field scontrol always prints after it.
_RESERVATION_LINE = re.compile(r"^ReservationName=(?P<name>.*?) (?P<rest>StartTime=.*)$")
_NULL = {"(null)", "", "N/A", "n/a", "None"}
# Lines of ``scontrol show node`` (multi-line form) whose value is free text to line end.
_FREE_TEXT_KEYS = ("Reason=", "Comment=", "Extra=", "OS=")


class SlurmError(Exception):
    """Raised when scontrol fails; ``message`` is scontrol's own text."""

    def __init__(self, message: str, *, command: Sequence[str] = (), returncode: int | None = None):
        super().__init__(message)
        self.message = message
        self.command = tuple(command)
        self.returncode = returncode


class SlurmUnavailable(SlurmError):
    """Raised when slurmctld cannot be reached or scontrol does not answer in time."""


class ReservationExists(SlurmError):
    """Raised when creating a reservation whose name is already taken."""


class ReservationNotFound(SlurmError):
    """Raised when updating or deleting a reservation Slurm does not know."""


class ReservationOverlap(SlurmError):
    """Raised when Slurm refuses a reservation because its nodes are already reserved.

    The portal's database never double-books a node, so this means Slurm and the portal
    disagree (a reservation made by hand, or drift): treat it as an incident, not a retry.
    """


class ReservationBusy(SlurmError):
    """Raised when deleting a reservation that jobs still name (running, ending, or only queued for it)."""


class ReservationAlreadyStarted(SlurmError):
    """Raised when changing the start time of a reservation that is already active."""


class NodeNotFound(SlurmError):
    """Raised when a node name is unknown to Slurm."""


class PartitionNotFound(SlurmError):
    """Raised when a reservation names a partition Slurm does not have."""


@dataclass(frozen=True)
class Reservation:
    """A Slurm reservation as ``scontrol show reservation`` reports it (times in UTC)."""

    name: str
    nodes: tuple[str, ...]
    start: datetime | None
    end: datetime | None
    accounts: frozenset[str]
    users: frozenset[str]
    flags: frozenset[str]
    state: str
    partition: str | None
    raw: Mapping[str, str] = field(repr=False, compare=False)
    # Unix groups whose members alone may use it (with Accounts=, a job needs both): the portal sets none.
    groups: frozenset[str] = frozenset()

    @property
    def active(self) -> bool:
        """Tell whether the reservation window has begun."""
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class NodeInfo:
    """A node as ``scontrol show node`` reports it.

    ``state`` is Slurm's full state string (``IDLE+DRAIN+NOT_RESPONDING``), ``base_state``
    its first word and ``state_flags`` the rest.
    """

    name: str
    state: str
    base_state: str
    state_flags: frozenset[str]
    reason: str | None
    partitions: tuple[str, ...]
    raw: Mapping[str, str] = field(repr=False, compare=False)

    @property
    def drained(self) -> bool:
        """Tell whether the node is draining or drained (no new jobs go to it)."""
        return "DRAIN" in self.state_flags or self.base_state in {"DRAIN", "DRAINED", "DRAINING"}

    @property
    def busy(self) -> bool:
        """Tell whether jobs still run (or are ending) on the node: ALLOCATED, MIXED or COMPLETING, drained or not."""
        return self.base_state in {"ALLOCATED", "MIXED", "COMPLETING", "DRAINING"} or "COMPLETING" in self.state_flags


@dataclass(frozen=True)
class Partition:
    """A partition as ``scontrol show partition`` reports it."""

    name: str
    nodes: tuple[str, ...]
    state: str
    default: bool
    raw: Mapping[str, str] = field(repr=False, compare=False)


_PARTITION_STATES = ("UP", "DOWN", "DRAIN", "INACTIVE")


class EnsureAction(enum.StrEnum):
    """What :meth:`SlurmClient.ensure_reservation` had to do."""

    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


@dataclass(frozen=True)
class EnsureResult:
    """What :meth:`SlurmClient.ensure_reservation` did, and the state it read back."""

    action: EnsureAction
    reservation: Reservation
    changed_fields: tuple[str, ...] = ()


def reservation_name(tenant_slug: str, reservation_id: int | str) -> str:
    """Return the Slurm reservation name for a portal reservation: ``<tenant>-<id>``."""
    name = f"{tenant_slug}-{reservation_id}"
    _check_name(name, "reservation name")
    return name


class SlurmClient:
    """Run ``scontrol`` against one cluster, named by its ``slurm.conf``.

    ``slurm_conf`` defaults to ``$SLURM_CONF`` (or Slurm's compiled-in default when unset).
    Every call runs scontrol with a timeout; a hung controller raises
    :class:`SlurmUnavailable` instead of blocking a Celery worker forever.
    """

    def __init__(
        self,
        slurm_conf: str | os.PathLike[str] | None = None,
        *,
        scontrol: str = "scontrol",
        scancel: str | None = None,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.slurm_conf = os.fspath(slurm_conf) if slurm_conf is not None else None
        self.scontrol = scontrol
        # scancel of the same installation: the one beside scontrol when that is a path, else the PATH's.
        beside = os.path.join(os.path.dirname(scontrol), "scancel") if os.path.dirname(scontrol) else ""
        self.scancel = scancel or (beside if beside and os.access(beside, os.X_OK) else "scancel")
        self.timeout = timeout
        self._base_env = dict(os.environ if env is None else env)

    # ----------------------------------------------------------------- reservations

    def create_reservation(
        self,
        name: str,
        nodes: Iterable[str],
        start: datetime,
        end: datetime,
        *,
        accounts: Iterable[str] = (),
        users: Iterable[str] = (),
        flags: Iterable[str] = (),
        partition: str | None = None,
    ) -> Reservation:
        """Create reservation ``name`` on exactly ``nodes`` for ``[start, end)``.

        Give ``accounts`` (the portal's choice: one Slurm account per tenant) or ``users``
        (names that must exist on the controller host). A ``start`` not in the future
        becomes Slurm's ``now``, since Slurm refuses start times in the past. Return the
        reservation as read back from slurmctld.
        """
        _check_name(name, "reservation name")
        node_list = _node_list(nodes)
        start_arg, end_arg = _window(start, end)
        accounts_t, users_t = _principals(accounts, users)
        argv = [
            "create",
            "reservation",
            f"ReservationName={name}",
            f"Nodes={node_list}",
            f"StartTime={start_arg}",
            f"EndTime={end_arg}",
        ]
        if accounts_t:
            argv.append(f"Accounts={','.join(accounts_t)}")
        if users_t:
            argv.append(f"Users={','.join(users_t)}")
        flags_t = _flags(flags)
        if flags_t:
            argv.append(f"Flags={','.join(flags_t)}")
        if partition is not None:
            _check_name(partition, "partition")
            argv.append(f"PartitionName={partition}")
        self._run(argv)
        return self._read_back(name)

    def update_reservation(
        self,
        name: str,
        *,
        nodes: Iterable[str] | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        accounts: Iterable[str] | None = None,
        users: Iterable[str] | None = None,
        groups: Iterable[str] | None = None,
        flags: Iterable[str] = (),
        partition: str | None = None,
    ) -> Reservation:
        """Change the given fields of reservation ``name``; leave the others as they are.

        ``accounts``/``users``/``groups`` replace the current lists (an empty one clears it); ``flags`` are added. Slurm
        refuses a new ``start`` once the reservation is active
        (:class:`ReservationAlreadyStarted`). Return the reservation as read back.
        """
        _check_name(name, "reservation name")
        argv = ["update", f"ReservationName={name}"]
        if nodes is not None:
            argv.append(f"Nodes={_node_list(nodes)}")
        if start is not None and end is not None:
            start_arg, end_arg = _window(start, end)
            argv += [f"StartTime={start_arg}", f"EndTime={end_arg}"]
        elif start is not None:
            argv.append(f"StartTime={_time_arg(start)}")
        elif end is not None:
            argv.append(f"EndTime={_slurm_time(_aware(end, 'end'))}")
        if accounts is not None:
            argv.append(f"Accounts={','.join(_names(accounts, 'account'))}")
        if users is not None:
            argv.append(f"Users={','.join(_names(users, 'user'))}")
        if groups is not None:
            argv.append(f"Groups={','.join(_names(groups, 'group'))}")
        flags_t = _flags(flags)
        if flags_t:
            argv.append(f"Flags={','.join(flags_t)}")
        if partition is not None:
            _check_name(partition, "partition")
            argv.append(f"PartitionName={partition}")
        if len(argv) == 2:
            raise ValueError("update_reservation needs at least one field to change")
        try:
            self._run(argv)
        except SlurmError as exc:
            raise self._not_found_if_absent(name, exc)
        return self._read_back(name)

    def delete_reservation(self, name: str, *, missing_ok: bool = False) -> None:
        """Delete reservation ``name``; with ``missing_ok`` an absent one is not an error."""
        _check_name(name, "reservation name")
        try:
            self._run(["delete", f"ReservationName={name}"])
        except SlurmError as exc:
            error = self._not_found_if_absent(name, exc)
            if missing_ok and isinstance(error, ReservationNotFound):
                return
            raise error

    def cancel_reservation_jobs(self, name: str) -> None:
        """Cancel every job of reservation ``name``, running or queued (``scancel --reservation``).

        Slurm will not delete a reservation that jobs still name; the jobs of one that is gone would
        never run anyway. No job (or no such reservation) is not an error.
        """
        _check_name(name, "reservation name")
        self._run([f"--reservation={name}"], program=self.scancel)

    def show_reservations(self) -> dict[str, Reservation]:
        """Return every reservation Slurm knows, by name."""
        output = self._run(["show", "reservation", "--oneliner"])
        reservations: dict[str, Reservation] = {}
        for line in output.splitlines():
            if not line.startswith("ReservationName="):
                continue  # "No reservations in the system"
            # The name is printed unquoted and may hold spaces and "Key=value" text (an operator's
            # "ops Users=x"): it runs up to StartTime=, which scontrol always prints next.
            named = _RESERVATION_LINE.match(line)
            if named is None:
                fields = _parse_fields(line.split())
            else:
                fields = {**_parse_fields(named["rest"].split()), "ReservationName": named["name"]}
            reservation = _parse_reservation(fields)
            reservations[reservation.name] = reservation
        return reservations

    def show_reservation(self, name: str) -> Reservation | None:
        """Return reservation ``name``, or ``None`` when Slurm does not know it."""
        return self.show_reservations().get(name)

    def ensure_reservation(
        self,
        name: str,
        nodes: Iterable[str],
        start: datetime,
        end: datetime,
        *,
        accounts: Iterable[str] = (),
        users: Iterable[str] = (),
        flags: Iterable[str] = (),
        partition: str | None = None,
        now: datetime | None = None,
    ) -> EnsureResult:
        """Make Slurm's reservation ``name`` match the arguments, doing as little as possible.

        Create it when absent, update only the differing fields when present, do nothing
        when equal, so a retried Celery task converges instead of failing. Equality is
        Slurm's view: node sets, times to the second, account/user sets, and the asked
        flags being a subset of Slurm's by name (Slurm adds its own, e.g. ``SPEC_NODES``,
        and rewrites values such as ``PURGE_COMP=30``). A ``start`` that is not in the
        future matches any reservation that has begun. Moving the start of a reservation
        that has begun raises :class:`ReservationAlreadyStarted`; a clash with another
        reservation raises :class:`ReservationOverlap`.

        The caller owns the reservation: accounts, users and groups not asked for (an operator's
        ``Users=`` or ``Groups=`` added by hand) are removed, and named in ``changed_fields``. Report such a
        difference before calling this (the backend's ``reconcile`` does) if it must be seen.
        """
        node_set = frozenset(_node_names(nodes))
        accounts_t, users_t = _principals(accounts, users)
        flags_t = _flags(flags)
        current = self.show_reservation(name)
        if current is None:
            try:
                created = self.create_reservation(
                    name,
                    node_set,
                    start,
                    end,
                    accounts=accounts_t,
                    users=users_t,
                    flags=flags_t,
                    partition=partition,
                )
            except ReservationExists:
                # Another worker created it between our read and our create: converge on it.
                current = self._read_back(name)
            else:
                return EnsureResult(EnsureAction.CREATED, created, ("created",))

        now = now or datetime.now(UTC)
        changes: dict[str, object] = {}
        if frozenset(current.nodes) != node_set:
            changes["nodes"] = node_set
        if not same_start(current, _aware(start, "start"), now):
            changes["start"] = start
        if current.end != _truncate(_aware(end, "end")):
            changes["end"] = end
        if current.accounts != frozenset(accounts_t):
            changes["accounts"] = accounts_t
        if current.users != frozenset(users_t):
            changes["users"] = users_t
        if current.groups:
            changes["groups"] = ()  # the caller's accounts and users say who may use it, nobody's groups
        # Compare flag names only: Slurm reformats values (PURGE_COMP=30 -> =00:30:00).
        current_flags = {flag.split("=")[0] for flag in current.flags}
        missing_flags = [flag for flag in flags_t if flag.split("=")[0] not in current_flags]
        if missing_flags:
            changes["flags"] = missing_flags
        if partition is not None and current.partition != partition:
            changes["partition"] = partition
        if not changes:
            return EnsureResult(EnsureAction.UNCHANGED, current)
        if "start" in changes and "end" not in changes:
            # Send the pair so Slurm never sees a transient start after the old end.
            changes["end"] = end
        updated = self.update_reservation(name, **changes)  # type: ignore[arg-type]
        return EnsureResult(EnsureAction.UPDATED, updated, tuple(sorted(changes)))

    # ------------------------------------------------------------------- partitions

    def show_partitions(self) -> dict[str, Partition]:
        """Return every partition Slurm knows, by name."""
        output = self._run(["show", "partition", "--oneliner"])
        partitions: dict[str, Partition] = {}
        for line in output.splitlines():
            if not line.startswith("PartitionName="):
                continue  # "No partitions in the system"
            fields = _parse_fields(line.split())
            partitions[fields["PartitionName"]] = Partition(
                name=fields["PartitionName"],
                nodes=tuple(hostlist.expand(_value(fields, "Nodes") or "")),
                state=fields.get("State", ""),
                default=fields.get("Default") == "YES",
                raw=dict(fields),
            )
        return partitions

    def update_partition(self, name: str, *, nodes: Iterable[str] | None = None,
                         state: str | None = None) -> Partition:
        """Set partition ``name``'s node list and/or state (UP, DOWN, DRAIN, INACTIVE); return it as read back."""
        _check_name(name, "partition")
        argv = ["update", f"PartitionName={name}"]
        if nodes is not None:
            argv.append(f"Nodes={_node_list(nodes)}")
        if state is not None:
            if state not in _PARTITION_STATES:
                raise ValueError(f"invalid partition state {state!r}")
            argv.append(f"State={state}")
        if len(argv) == 2:
            raise ValueError("update_partition needs at least one field to change")
        self._run(argv)
        partition = self.show_partitions().get(name)
        if partition is None:
            raise SlurmError(f"Partition {name} not found", command=argv)
        return partition

    # ------------------------------------------------------------------------ nodes

    def show_node(self, hostname: str) -> NodeInfo:
        """Return Slurm's view of node ``hostname``."""
        _check_name(hostname, "hostname")
        output = self._run(["show", "node", hostname])
        node = _parse_node_records(output).get(hostname)
        if node is None:
            raise NodeNotFound(f"Node {hostname} not found", command=("show", "node", hostname))
        return node

    def show_nodes(self) -> dict[str, NodeInfo]:
        """Return every node Slurm knows, by name, read with one ``scontrol show node``.

        One subprocess and one RPC to slurmctld whatever the number of nodes: a reconcile of a
        large fleet must not ask node by node.
        """
        return _parse_node_records(self._run(["show", "node"]))

    def drain_node(self, hostname: str, reason: str) -> NodeInfo:
        """Drain node ``hostname`` with ``reason`` (no new jobs; running ones finish)."""
        _check_name(hostname, "hostname")
        if not reason.strip() or any(ord(char) < 32 for char in reason):
            raise ValueError("drain reason must be non-empty single-line text")
        self._run(["update", f"NodeName={hostname}", "State=DRAIN", f"Reason={reason}"])
        return self.show_node(hostname)

    def resume_node(self, hostname: str) -> NodeInfo:
        """Return drained node ``hostname`` to service."""
        _check_name(hostname, "hostname")
        self._run(["update", f"NodeName={hostname}", "State=RESUME"])
        return self.show_node(hostname)

    def ping(self) -> bool:
        """Tell whether the primary slurmctld answers."""
        try:
            output = self._run(["ping"])
        except SlurmError:
            return False
        return "is UP" in output

    # --------------------------------------------------------------------- plumbing

    @property
    def env(self) -> dict[str, str]:
        """Return the environment scontrol runs with."""
        env = dict(self._base_env)
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = self.slurm_conf
        env["TZ"] = "UTC"
        env["SLURM_TIME_FORMAT"] = "standard"
        # Error classification matches scontrol's English messages.
        env["LC_ALL"] = "C"
        return env

    def _run(self, args: Sequence[str], *, program: str | None = None) -> str:
        command = [program or self.scontrol, *args]
        try:
            proc = subprocess.run(  # noqa: S603 - fixed argv, no shell
                command,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"scontrol did not answer within {self.timeout:g}s", command=command)
        except FileNotFoundError:
            raise SlurmError(f"{os.path.basename(command[0])} not found ({command[0]!r})", command=command)
        if proc.returncode != 0:
            message = _error_message(proc.stderr, proc.stdout)
            raise _classify(message)(message, command=command, returncode=proc.returncode)
        return proc.stdout

    def _read_back(self, name: str) -> Reservation:
        reservation = self.show_reservation(name)
        if reservation is None:
            raise ReservationNotFound(f"Reservation {name} not found")
        return reservation

    def _not_found_if_absent(self, name: str, error: SlurmError) -> SlurmError:
        """Turn Slurm's vague "reservation is invalid" into ReservationNotFound when true.

        slurmctld answers ``ESLURM_RESERVATION_INVALID`` both for an unknown name and for
        some invalid requests, so we check which one it was.
        """
        if type(error) is SlurmError and "reservation is invalid" in error.message.lower():
            if self.show_reservation(name) is None:
                return ReservationNotFound(error.message, command=error.command, returncode=error.returncode)
        return error


# ------------------------------------------------------------------------ helpers


# Transient outages of slurmctld or munged, not a refusal: "protocol authentication error" is munge down
# (or keys that differ), "zero bytes were transmitted or received" a controller that dropped the RPC. With
# munged down on either side scontrol may say only what the auth plugin or the RPC layer saw: the plugin's
# "Munge encode/decode failed: ...", Slurm's ESLURM_AUTH_* texts ("Invalid authentication credential",
# "Authentication credential expired": clocks apart), or SLURM_UNEXPECTED_MSG_ERROR, "Unexpected message
# received" (the controller's answer was not the reply to the request: it could not authenticate it).
_UNAVAILABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "protocol authentication error",
    "zero bytes were transmitted or received",
    "unexpected message received",
    "munge encode failed",
    "munge decode failed",
    "invalid authentication credential",
    "authentication credential expired",
)


def _classify(message: str) -> type[SlurmError]:
    text = message.lower()
    if "overlaps with another reservation" in text:
        return ReservationOverlap
    if "duplicate reservation name" in text:
        return ReservationExists
    if "reservation is in use" in text:
        return ReservationBusy
    if "reservation already started" in text:
        return ReservationAlreadyStarted
    if re.search(r"reservation \S+ not found", text):
        return ReservationNotFound
    if re.search(r"node \S+ not found", text) or "invalid node name specified" in text:
        return NodeNotFound
    if "invalid partition name specified" in text:
        return PartitionNotFound
    if any(sign in text for sign in _UNAVAILABLE):
        return SlurmUnavailable
    return SlurmError


def _error_message(stderr: str, stdout: str) -> str:
    lines = [line.strip() for line in (stderr + "\n" + stdout).splitlines() if line.strip()]
    # scontrol repeats the same error as "Error updating the reservation: X" and
    # "slurm_update error: X"; keep each distinct line once.
    return "; ".join(dict.fromkeys(lines)) or "scontrol failed without a message"


def _parse_fields(tokens: Iterable[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    key: str | None = None
    for token in tokens:
        if _FIELD_START.match(token):
            key, _, value = token.partition("=")
            fields[key] = value
        elif key is not None:
            fields[key] = f"{fields[key]} {token}"
    return fields


def _parse_reservation(fields: Mapping[str, str]) -> Reservation:
    return Reservation(
        name=fields["ReservationName"],
        nodes=tuple(hostlist.expand(_value(fields, "Nodes") or "")),
        start=_parse_time(fields.get("StartTime")),
        end=_parse_time(fields.get("EndTime")),
        accounts=_csv(fields, "Accounts"),
        users=_csv(fields, "Users"),
        groups=_csv(fields, "Groups"),
        flags=_csv(fields, "Flags"),
        state=fields.get("State", ""),
        partition=_value(fields, "PartitionName"),
        raw=dict(fields),
    )


def _parse_node_records(output: str) -> dict[str, NodeInfo]:
    """Parse the multi-line form of ``scontrol show node``: one record per node, each opening with ``NodeName=``.

    The multi-line form (not ``--oneliner``) keeps free-text fields (Reason) on lines of their
    own, which is unambiguous even when a reason contains "key=value" text ("State=IDLE").
    """
    records: list[dict[str, str]] = []
    for line in output.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("NodeName="):
            records.append({})
        elif not records:
            continue  # not a node record ("No nodes in the system")
        free = next((key for key in _FREE_TEXT_KEYS if stripped.startswith(key)), None)
        if free is not None:
            records[-1][free[:-1]] = stripped[len(free) :]
        else:
            records[-1].update(_parse_fields(stripped.split()))
    return {fields["NodeName"]: _parse_node(fields) for fields in records if fields.get("NodeName")}


def _parse_node(fields: Mapping[str, str]) -> NodeInfo:
    state = fields.get("State", "UNKNOWN")
    base, *rest = state.split("+")
    reason = _value(fields, "Reason")
    return NodeInfo(
        name=fields["NodeName"],
        state=state,
        base_state=base.rstrip("*~#!%$@^-"),
        state_flags=frozenset(rest),
        # Slurm appends "[user@time]" to the reason it stores; give back what was set.
        reason=re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", reason) if reason else None,
        partitions=tuple(sorted(_csv(fields, "Partitions"))),
        raw=dict(fields),
    )


def _value(fields: Mapping[str, str], key: str) -> str | None:
    value = fields.get(key)
    return None if value is None or value in _NULL else value


def _csv(fields: Mapping[str, str], key: str) -> frozenset[str]:
    value = _value(fields, key)
    return frozenset(item for item in value.split(",") if item) if value else frozenset()


def _parse_time(value: str | None) -> datetime | None:
    if value is None or value in _NULL or value in {"Unknown", "INFINITE"}:
        return None
    return datetime.strptime(value, _TIME_FORMAT).replace(tzinfo=UTC)


def _aware(value: datetime, what: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be an aware datetime, got {value!r}")
    return value


def _truncate(value: datetime) -> datetime:
    """Return ``value`` in UTC without sub-second precision, as Slurm stores it."""
    return value.astimezone(UTC).replace(microsecond=0)


def _slurm_time(value: datetime) -> str:
    return _truncate(value).strftime(_TIME_FORMAT)


def _time_arg(start: datetime) -> str:
    start = _aware(start, "start")
    # Slurm refuses a StartTime in the past; the portal books "the running slot", so a
    # start that has already passed means "as soon as possible".
    return "now" if start <= datetime.now(UTC) else _slurm_time(start)


def _window(start: datetime, end: datetime) -> tuple[str, str]:
    start, end = _aware(start, "start"), _aware(end, "end")
    if end <= start:
        raise ValueError(f"end ({end.isoformat()}) must be after start ({start.isoformat()})")
    return _time_arg(start), _slurm_time(end)


def same_start(current: Reservation, start: datetime, now: datetime) -> bool:
    """Tell whether Slurm's reservation starts as asked (a start not in the future: it has begun)."""
    if start <= now:
        return current.active or (current.start is not None and current.start <= now)
    return current.start == _truncate(start)


def _node_names(nodes: Iterable[str]) -> list[str]:
    if isinstance(nodes, str):
        # Accept a hostlist string as well as a list of names.
        names = hostlist.expand(nodes)
    else:
        names = list(dict.fromkeys(nodes))
    if not names:
        raise ValueError("a reservation needs at least one node")
    for name in names:
        _check_name(name, "hostname")
    return names


def _node_list(nodes: Iterable[str]) -> str:
    return hostlist.compress(_node_names(nodes))


def _names(values: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(values, str):
        values = [values]
    names = tuple(sorted(set(values)))
    for name in names:
        _check_name(name, what)
    return names


def _principals(accounts: Iterable[str], users: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    accounts_t, users_t = _names(accounts, "account"), _names(users, "user")
    if not accounts_t and not users_t:
        raise ValueError("a reservation needs accounts or users")
    return accounts_t, users_t


def _flags(flags: Iterable[str]) -> tuple[str, ...]:
    if isinstance(flags, str):
        flags = flags.split(",")
    result = tuple(dict.fromkeys(flag.strip().upper() for flag in flags if flag.strip()))
    for flag in result:
        if not _FLAG.match(flag):
            raise ValueError(f"invalid reservation flag {flag!r}")
    return result


def _check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"invalid {what} {value!r}: use letters, digits, '_', '.', '-'")
