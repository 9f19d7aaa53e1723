"""Start a real, private slurmctld (with its own munged) for tests and local experiments.

``SlurmTestCluster`` writes a ``slurm.conf`` for the node names it is given, a fresh munge
key, and runs ``munged`` and ``slurmctld`` with every path (socket, key, pid, log, state)
under its work directory and the controller on a free port, so it never reads or touches
``/etc/slurm``, ``/etc/munge`` or a system munged, and its state starts empty each time.

No ``slurmd`` runs: the nodes exist only in the controller's configuration. What makes
reservations and drain/resume work on them anyway (see :func:`render_slurm_conf`):

- ``SlurmdTimeout=0`` — never mark a node DOWN for not answering pings;
- nodes start ``State=DOWN`` and the launcher issues ``State=RESUME`` once the controller
  is up, which makes them IDLE (a node left UNKNOWN cannot be resumed after a drain);
- ``Accounts=`` in reservations is accepted without slurmdbd: with
  ``AccountingStorageType=accounting_storage/none`` no associations are loaded and
  nothing is enforced, so slurmctld does not check that an account exists. (``Users=``
  also works, but only for names in the controller host's passwd database.)

Needs Debian's ``slurmctld``, ``slurm-client`` and ``munge`` (``scripts/install-slurm.sh``).
Run it as root or as any user: that user becomes ``SlurmUser``, which may manage
reservations.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from provisioning.backends import hostlist
from provisioning.backends.slurm_client import SlurmClient

__all__ = ["SlurmBinariesMissing", "SlurmStartError", "SlurmTestCluster", "render_slurm_conf"]

INSTALL_HINT = "install them with scripts/install-slurm.sh (Debian: slurmctld slurm-client munge)"
# Debian puts the daemons in /usr/sbin, which a non-login PATH often lacks.
_EXTRA_PATH = ("/usr/sbin", "/sbin", "/usr/local/sbin")
# AF_UNIX socket paths are limited to 108 bytes including the terminator.
_MAX_SOCKET_PATH = 100


class SlurmBinariesMissing(RuntimeError):
    """Raised when slurmctld, scontrol or munged is not installed."""


class SlurmStartError(RuntimeError):
    """Raised when munged or slurmctld does not come up; carries the log tail."""


def render_slurm_conf(
    *,
    cluster_name: str,
    controller_host: str,
    port: int,
    slurmd_port: int,
    slurm_user: str,
    munge_socket: Path,
    state_dir: Path,
    spool_dir: Path,
    pid_file: Path,
    log_file: Path,
    nodes: list[str],
    partition: str,
) -> str:
    """Return a minimal ``slurm.conf`` for a controller-only test cluster."""
    node_list = hostlist.compress(nodes)
    return "\n".join(
        [
            f"ClusterName={cluster_name}",
            # slurmctld refuses to start unless SlurmctldHost names this machine; the address
            # in brackets keeps all traffic on loopback.
            f"SlurmctldHost={controller_host}(127.0.0.1)",
            f"SlurmctldPort={port}",
            f"SlurmdPort={slurmd_port}",
            f"SlurmUser={slurm_user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # Our own munged, not /run/munge: the tests must not depend on system services.
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={state_dir}",
            f"SlurmdSpoolDir={spool_dir}",
            f"SlurmctldPidFile={pid_file}",
            f"SlurmctldLogFile={log_file}",
            "SlurmctldDebug=info",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            # No slurmdbd: no associations, so Accounts= in reservations is not validated.
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            # There is no slurmd: never mark a node DOWN for missing pings.
            "SlurmdTimeout=0",
            "ReturnToService=2",
            "MessageTimeout=10",
            # DOWN, then RESUME from the launcher, gives IDLE nodes that drain and resume
            # like real ones (UNKNOWN nodes refuse RESUME after a drain).
            f"NodeName={node_list} NodeAddr=127.0.0.1 CPUs=1 RealMemory=1000 State=DOWN "
            'Reason="test cluster: no slurmd"',
            f"PartitionName={partition} Nodes={node_list} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class SlurmTestCluster:
    """Run a private munged + slurmctld for ``nodes``; use as a context manager.

    ``workdir`` receives the config, key, state and logs (kept after exit for debugging).
    ``.env`` is the environment a Slurm client needs (``SLURM_CONF``); ``.client()``
    returns a :class:`SlurmClient` bound to this cluster.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        nodes: list[str],
        partition: str = "gpu",
        *,
        cluster_name: str = "portaltest",
        startup_timeout: float = 30.0,
        path: str | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("a test cluster needs at least one node")
        self.workdir = Path(workdir).resolve()
        self.nodes = list(nodes)
        self.partition = partition
        self.cluster_name = cluster_name
        self.startup_timeout = startup_timeout
        search = path if path is not None else os.environ.get("PATH", "")
        self._search_path = os.pathsep.join([search, *_EXTRA_PATH]) if path is None else search
        self.slurm_conf = self.workdir / "slurm.conf"
        self.munge_dir = self.workdir / "munge"
        self.munge_key = self.munge_dir / "munge.key"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.port: int | None = None
        self._munged: subprocess.Popen[bytes] | None = None
        self._slurmctld: subprocess.Popen[bytes] | None = None
        self._short_socket_dir: Path | None = None
        self._binaries: dict[str, str] = {}
        self._handles: list[IO[bytes]] = []

    # ----------------------------------------------------------------- public API

    @property
    def env(self) -> dict[str, str]:
        """Return the variables a Slurm client needs to talk to this cluster."""
        scontrol_dir = os.path.dirname(self._binaries.get("scontrol", "scontrol"))
        return {
            "SLURM_CONF": str(self.slurm_conf),
            "PATH": os.pathsep.join(filter(None, [scontrol_dir, os.environ.get("PATH", "")])),
        }

    def client(self, timeout: float = 30.0) -> SlurmClient:
        """Return a :class:`SlurmClient` for this cluster."""
        return SlurmClient(self.slurm_conf, scontrol=self._binaries.get("scontrol", "scontrol"), timeout=timeout)

    @property
    def log_file(self) -> Path:
        """Return the slurmctld log path."""
        return self.workdir / "log" / "slurmctld.log"

    def start(self) -> SlurmTestCluster:
        """Write the configuration and start munged and slurmctld; wait until both answer."""
        self._binaries = self._find_binaries()
        try:
            self._stop_leftovers()
            self._prepare_dirs()
            self._start_munged()
            self._start_slurmctld()
            self._resume_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop slurmctld, then munged; kill whatever is left of their process groups."""
        for attr in ("_slurmctld", "_munged"):
            proc = getattr(self, attr)
            if proc is not None:
                _terminate(proc)
                setattr(self, attr, None)
        for handle in self._handles:
            handle.close()
        self._handles.clear()
        if self._short_socket_dir is not None:
            shutil.rmtree(self._short_socket_dir, ignore_errors=True)
            self._short_socket_dir = None

    def __enter__(self) -> SlurmTestCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------- internals

    def _find_binaries(self) -> dict[str, str]:
        found: dict[str, str] = {}
        missing: list[str] = []
        for name in ("slurmctld", "scontrol", "munged"):
            location = shutil.which(name, path=self._search_path)
            if location is None:
                missing.append(name)
            else:
                found[name] = location
        if missing:
            raise SlurmBinariesMissing(
                f"cannot start a test Slurm cluster: {', '.join(missing)} not found; {INSTALL_HINT}"
            )
        return found

    def _prepare_dirs(self) -> None:
        # slurmctld -c still restores reservations and nodes from StateSaveLocation, so a
        # fresh, empty state directory is what makes every start independent of the last.
        shutil.rmtree(self.workdir / "state", ignore_errors=True)
        for sub in ("state", "log", "spool"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        # munged insists the socket directory be readable and searchable by all and not
        # writable by others, and the key readable only by its owner.
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o755)
        self.munge_key.unlink(missing_ok=True)
        fd = os.open(self.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as key:
            key.write(os.urandom(1024))
        socket_path = self.munge_dir / "munge.socket"
        if len(str(socket_path)) > _MAX_SOCKET_PATH:
            # Deep work directories overflow AF_UNIX's path limit; put only the socket in a
            # short private directory, removed on stop.
            self._short_socket_dir = Path(tempfile.mkdtemp(prefix="munge-", dir="/tmp"))
            self._short_socket_dir.chmod(0o755)
            socket_path = self._short_socket_dir / "munge.socket"
        self.munge_socket = socket_path

    def _log_handle(self, path: Path) -> IO[bytes]:
        handle = path.open("ab")
        self._handles.append(handle)
        return handle

    def _stop_leftovers(self) -> None:
        """Kill daemons a crashed earlier run left behind in this same work directory.

        Only processes named in our pid files whose command line mentions our work
        directory are touched, so nothing else on the machine can be hit.
        """
        for pid_file in (self.workdir / "slurmctld.pid", self.munge_dir / "munged.pid"):
            try:
                pid = int(pid_file.read_text().strip())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if str(self.workdir).encode() in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, 5.0)
            pid_file.unlink(missing_ok=True)

    def _start_munged(self) -> None:
        log = self.munge_dir / "munged.log"
        self._munged = subprocess.Popen(  # noqa: S603 - fixed argv
            [
                self._binaries["munged"],
                "--foreground",
                # --force: pytest's base temp dir is private (0700), which munged's
                # directory checks would reject; the daemon is private to this run anyway.
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={self.munge_key}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--log-file={log}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle(self.munge_dir / "munged.out"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout
        while not self.munge_socket.exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise SlurmStartError(f"munged did not start:\n{_tail(self.munge_dir / 'munged.out')}\n{_tail(log)}")
            time.sleep(0.05)

    def _start_slurmctld(self) -> None:
        for attempt in range(3):
            self.port, slurmd_port = _free_port(), _free_port()
            self.slurm_conf.write_text(
                render_slurm_conf(
                    cluster_name=self.cluster_name,
                    controller_host=socket.gethostname().split(".")[0],
                    port=self.port,
                    slurmd_port=slurmd_port,
                    slurm_user=pwd.getpwuid(os.getuid()).pw_name,
                    munge_socket=self.munge_socket,
                    state_dir=self.workdir / "state",
                    spool_dir=self.workdir / "spool",
                    pid_file=self.workdir / "slurmctld.pid",
                    log_file=self.log_file,
                    nodes=self.nodes,
                    partition=self.partition,
                )
            )
            self.log_file.unlink(missing_ok=True)
            self._slurmctld = subprocess.Popen(  # noqa: S603 - fixed argv
                # -D: stay in the foreground so we own the process; -c: cold start, ignore
                # any state a previous run left in this directory.
                [self._binaries["slurmctld"], "-D", "-c", "-f", str(self.slurm_conf)],
                cwd=self.workdir,
                env={**os.environ, "SLURM_CONF": str(self.slurm_conf)},
                stdin=subprocess.DEVNULL,
                stdout=self._log_handle(self.workdir / "log" / "slurmctld.out"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            if self._wait_for_ping():
                return
            log = _tail(self.log_file) + _tail(self.workdir / "log" / "slurmctld.out")
            _terminate(self._slurmctld)
            self._slurmctld = None
            # The port we picked may have been taken between probing and binding: retry.
            if "Address already in use" not in log or attempt == 2:
                raise SlurmStartError(f"slurmctld did not answer `scontrol ping`:\n{log}")

    def _wait_for_ping(self) -> bool:
        client = self.client(timeout=5.0)
        deadline = time.monotonic() + self.startup_timeout
        assert self._slurmctld is not None
        while time.monotonic() < deadline:
            if self._slurmctld.poll() is not None:
                return False
            if client.ping():
                return True
            time.sleep(0.2)
        return False

    def _resume_nodes(self) -> None:
        client = self.client()
        client._run(["update", f"NodeName={hostlist.compress(self.nodes)}", "State=RESUME"])
        for node in self.nodes:
            info = client.show_node(node)
            if info.base_state != "IDLE":
                raise SlurmStartError(f"node {node} is {info.state} after RESUME, expected IDLE")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stop a daemon we started in its own session, and anything it left in its group.

    The daemon led a new session (``start_new_session``), so its process group id is its
    pid and holds only it and its children. We signal the group while the leader is alive
    or an unreaped zombie, so the id cannot have been reused by an unrelated process.
    """
    if proc.returncode is None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        if not _exited_unreaped(proc.pid, timeout):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            _exited_unreaped(proc.pid, timeout)
        # The leader is now a zombie we have not reaped: kill leftovers (e.g. a MailProg).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _exited_unreaped(pid: int, timeout: float) -> bool:
    """Wait until child ``pid`` has exited, without reaping it; tell whether it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.05)
    return False


def _wait_gone(pid: int, timeout: float) -> None:
    """Wait until ``pid`` is gone or a zombie (a zombie holds no resources any more)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        # The state letter follows the parenthesised command name, which may hold spaces.
        if stat.rpartition(")")[2].split()[:1] == ["Z"]:
            return
        time.sleep(0.05)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
    except OSError:
        return ""
