#!/usr/bin/env bash
# Install what `ems bench` compares ems against. Idempotent: run it again any time.
#
#   bash benchmarks/setup-peers.sh            # Redis, Mooncake Store, plotting
#   EMS_BENCH_LMCACHE=1 bash benchmarks/setup-peers.sh   # also the optional LMCache peer
#
# * Redis: Debian redis-server (started by the bench on a unix socket in a temp dir,
#   persistence off) and redis-py with the hiredis parser.
# * Mooncake Store: the PyPI `-non-cuda` wheel (the default wheel needs libcuda.so.1),
#   which needs Debian libibverbs1 + ibverbs-providers to import.
# * matplotlib for docs/bench.png.
# * LMCache (optional): its wheel depends on a CUDA torch, so it is installed with
#   --no-deps next to the CPU torch already present. Never installs torch.
set -euo pipefail

PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

need_apt=()
dpkg -s libibverbs1 >/dev/null 2>&1 || need_apt+=(libibverbs1)
dpkg -s ibverbs-providers >/dev/null 2>&1 || need_apt+=(ibverbs-providers)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup-peers: apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# The Debian package starts a system-wide redis on port 6379 where an init system runs;
# the bench never uses it (it starts its own on a unix socket).

"$PY" - <<'PY' || pip_install "redis>=5" "hiredis>=2"
import redis, hiredis  # noqa: F401
PY
"$PY" -c "import matplotlib" 2>/dev/null || pip_install "matplotlib>=3.7"
"$PY" -c "from mooncake.store import MooncakeDistributedStore" 2>/dev/null \
    || pip_install mooncake-transfer-engine-non-cuda

if [ "${EMS_BENCH_LMCACHE:-0}" = 1 ]; then
    "$PY" -c "import lmcache" 2>/dev/null || pip_install --no-deps lmcache
fi

"$PY" - <<'PY'
import importlib
for mod in ("redis", "hiredis", "matplotlib", "mooncake.store"):
    try:
        importlib.import_module(mod)
        print(f"setup-peers: {mod:15s} ok")
    except Exception as exc:  # noqa: BLE001
        print(f"setup-peers: {mod:15s} FAILED: {type(exc).__name__}: {exc}")
PY
command -v redis-server >/dev/null && echo "setup-peers: redis-server    $(redis-server --version | awk '{print $3}')"
