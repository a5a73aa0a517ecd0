#!/usr/bin/env bash
# Install the servers the tests start and stop themselves (Redis, Prometheus, Alertmanager), touching
# the system as little as possible:
#   - only the binaries missing from PATH, from Debian, --no-install-recommends (no node-exporter,
#     smartmontools, SNMP libraries...); no PyPI package ships these servers for this platform;
#   - Debian's postinst scripts enable and start each package's service. A policy-rc.d that answers
#     101 ("action forbidden") keeps invoke-rc.d from starting them during the install; afterwards the
#     units are disabled, and stopped where systemd runs, so nothing runs now or starts at boot.
# Works as root (CI) or through sudo. Prints one line saying what it installs, nothing when all is there.
#
#   .ci/install-services.sh [--dry-run]    --dry-run (or SITS_SERVICES_DRY_RUN=1): print the commands only
set -euo pipefail

BINARIES=(redis-server prometheus prometheus-alertmanager)  # each is also its Debian package and unit name
POLICY="${SITS_POLICY_RC:-/usr/sbin/policy-rc.d}"  # Debian's path; the variable is for tests

dry_run="${SITS_SERVICES_DRY_RUN:-}"
[ "${1:-}" = "--dry-run" ] && dry_run=1

missing=()
for binary in "${BINARIES[@]}"; do
  command -v "$binary" >/dev/null 2>&1 || missing+=("$binary")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=()
[ "$(id -u)" = 0 ] || sudo=(sudo)

run() {  # a privileged command, or its echo in a dry run
  if [ -n "$dry_run" ]; then
    echo "+ ${sudo[*]:+${sudo[*]} }$*"
  else
    "${sudo[@]}" "$@"
  fi
}

echo "make test: installing ${missing[*]} from Debian (apt-get, --no-install-recommends; their system services are left disabled and stopped)"

own_policy=""
if [ ! -e "$POLICY" ]; then  # an existing policy (Docker images have one) stays as it is
  own_policy=1
  run sh -c "printf '#!/bin/sh\\nexit 101\\n' > $POLICY && chmod 755 $POLICY"
fi
cleanup() { if [ -n "$own_policy" ]; then run rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
install=(apt-get install -y -q --no-install-recommends "${missing[@]}")
if [ -n "$dry_run" ]; then
  run "${install[@]}"
elif ! run "${install[@]}" >/dev/null 2>&1; then
  run apt-get update -q >/dev/null  # a fresh machine has no package lists yet
  run "${install[@]}" >/dev/null
fi

if [ -n "$dry_run" ] || command -v systemctl >/dev/null 2>&1; then
  for unit in "${missing[@]}"; do
    run systemctl disable --quiet "$unit.service" 2>/dev/null || true
    if [ -n "$dry_run" ] || [ -d /run/systemd/system ]; then  # systemd is running: stop what it may have started
      run systemctl stop "$unit.service" 2>/dev/null || true
    fi
  done
fi

if [ -z "$dry_run" ]; then
  for binary in "${missing[@]}"; do
    command -v "$binary" >/dev/null || { echo "missing $binary after the install" >&2; exit 1; }
  done
fi
