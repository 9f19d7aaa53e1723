#!/usr/bin/env bash
# Debian packages that the test suite drives for real: Chromium (Playwright's browser),
# Slurm + munge (the real slurmctld backend), promtool (metrics validation) and
# docker-compose (compose-file validation; no engine is needed). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

want=(chromium prometheus docker-compose)
missing=()
for pkg in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    SUDO=(sudo -n)  # a non-root runner: passwordless sudo, as install-slurm.sh uses
fi
if ((${#missing[@]})); then
    echo "install-system-deps: installing ${missing[*]}"
    "${SUDO[@]}" apt-get update -qq
    # prometheus' postinst starts a server through systemd when there is one; policy-rc.d keeps it off
    # (one that was there before is put back afterwards).
    had_policy=0
    if [ -e /usr/sbin/policy-rc.d ]; then
        had_policy=1
        "${SUDO[@]}" cp -p /usr/sbin/policy-rc.d /usr/sbin/policy-rc.d.portal-saved
    fi
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${SUDO[@]}" chmod +x /usr/sbin/policy-rc.d
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if [ "$had_policy" -eq 1 ]; then
        "${SUDO[@]}" mv /usr/sbin/policy-rc.d.portal-saved /usr/sbin/policy-rc.d
    else
        "${SUDO[@]}" rm -f /usr/sbin/policy-rc.d
    fi
fi
bash scripts/install-slurm.sh
