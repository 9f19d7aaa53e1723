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
    policy=${PORTAL_POLICY_RC_D:-/usr/sbin/policy-rc.d}  # another path only for the script's own test
    had_policy=0
    if [ -e "$policy" ]; then
        had_policy=1
        "${SUDO[@]}" cp -p "$policy" "$policy.portal-saved"
    fi
    restore_policy() {
        if [ "$had_policy" -eq 1 ]; then
            "${SUDO[@]}" mv "$policy.portal-saved" "$policy"
        else
            "${SUDO[@]}" rm -f "$policy"
        fi
    }
    # Put it back however the install ends: a failed apt-get must not leave every service start refused.
    trap restore_policy EXIT
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
    "${SUDO[@]}" chmod +x "$policy"
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    restore_policy
    trap - EXIT
fi
bash scripts/install-slurm.sh
