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
if ((${#missing[@]})); then
    echo "install-system-deps: installing ${missing[*]}"
    apt-get update -qq
    # prometheus' postinst starts a server through systemd when there is one; policy-rc.d keeps it off.
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    rm -f /usr/sbin/policy-rc.d
fi
bash scripts/install-slurm.sh
