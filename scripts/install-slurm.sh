#!/usr/bin/env bash
# Install the Slurm controller, client and munge from Debian, for the real-slurmctld tests.
#
# Idempotent and non-interactive: when every binary the tests need is already on PATH it
# does nothing; it runs `apt-get update` only when the package lists are missing or a
# first install attempt fails. Debian's packages start their services through systemd
# when one is running; we stop and disable those units, because the test launcher
# (provisioning/slurm_testing.py) runs its own munged and slurmctld with private paths
# and never relies on /etc/slurm or the system munge socket.
set -euo pipefail

PACKAGES=(slurmctld slurm-client munge)
BINARIES=(slurmctld scontrol munged)

have_all() {
    local bin
    for bin in "${BINARIES[@]}"; do
        command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || return 1
    done
}

if have_all; then
    echo "install-slurm: slurmctld, scontrol and munge already installed"
    exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    SUDO=(sudo -n)
fi

export DEBIAN_FRONTEND=noninteractive
APT_OPTS=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

# Update only when there are no lists yet; if the install then fails (stale lists after a
# point release), update once and retry.
if ! compgen -G "/var/lib/apt/lists/*_Packages" >/dev/null; then
    "${SUDO[@]}" apt-get update -q
fi
if ! "${SUDO[@]}" apt-get install "${APT_OPTS[@]}" "${PACKAGES[@]}"; then
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" apt-get install "${APT_OPTS[@]}" "${PACKAGES[@]}"
fi

# The system services are not used by the tests; keep them from holding the default ports.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    "${SUDO[@]}" systemctl disable --now slurmctld.service munge.service >/dev/null 2>&1 || true
fi

have_all || { echo "install-slurm: packages installed but binaries still missing" >&2; exit 1; }
echo "install-slurm: installed ${PACKAGES[*]} ($(/usr/sbin/slurmctld -V 2>/dev/null || true))"
