#!/usr/bin/env bash
# Installs the system packages the tests and the demo need (Debian): redis-server, and chromium
# for the dashboard's browser tests (Playwright drives the system's browser; none is downloaded).
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v chromium >/dev/null || need+=(chromium)
if ((${#need[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "FleetBroker needs: ${need[*]} (Debian: sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
