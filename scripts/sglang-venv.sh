#!/usr/bin/env bash
# Creates (or reuses) the separate virtualenv in which a real SGLang (0.5.23, on a CPU
# torch) runs with ems as its HiCache L3, for tests/sglang/ and benchmarks/sglang_ttft.py.
#
#   bash scripts/sglang-venv.sh          # build from scripts/sglang-cpu.lock, or reuse
#
# SGLang publishes no CPU build usable on an AVX2 machine: the sglang wheel requires an
# exact CUDA torch and CUDA kernel packages, and its CPU path needs AMX and a kernel
# build that is not on the registries. So the lock is installed with
# `pip install --no-deps -r LOCK` (no resolver: a resolver would replace the CPU torch
# with a CUDA build) and the test harness (tests/sglang/shim/, never src/) stubs
# `sgl_kernel` and patches three CUDA-only spots of the host pool at import time.
# The lock was written by hand from a working install (there is nothing to --relock
# against). One edit in site-packages: torchvision (imported unconditionally by
# sglang.srt.configs) is a CUDA build whose `register_fake("torchvision::nms")` crashes
# on a CPU torch; the script applies those two decorators only when torchvision's ops
# are loaded.
#
# The venv is reused while the lock file's sha256 (and the interpreter's version)
# equal the stamp file inside it ($VENV/.ems-lock-sha256); otherwise it is rebuilt
# (~3 min, 3 GB). ems itself is not installed into it: a .pth file puts this
# checkout's src/ on the venv's path (rewritten on every call).
#
# torch==2.13.0+cpu is not on PyPI: it is the local wheel pip finds through its
# configured find-links. Without it, this script prints ONE line starting with
# "SKIP:" and exits with code 3 (callers skip on 3 and fail on any other non-zero code).
#
# Environment: EMS_SGLANG_VENV (venv path, default <repo>/.venv-sglang),
# PYTHON (the interpreter to build it from, default python3).
# On success the last line of stdout is the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VENV="${EMS_SGLANG_VENV:-$REPO/.venv-sglang}"
LOCK="$REPO/scripts/sglang-cpu.lock"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0+cpu"
STAMP="$VENV/.ems-lock-sha256"
SKIP_RC=3
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() { grep -v -e "Running pip as the 'root' user" -e "is ignored: it is neither" || true; }

link_ems() {
  local site
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$REPO/src" > "$site/ems-checkout.pth"
}

lock_sha() { echo "$(sha256sum "$LOCK" | cut -d' ' -f1) python-$("$PY" -c 'import sys; print(sys.version.split()[0])')"; }

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(lock_sha)" ]; then
  link_ems
  echo "sglang-venv: reusing $VENV (lock sha256 unchanged)" >&2
  echo "$VENV/bin/python"
  exit 0
fi

if ! "$PY" -m pip install --dry-run --no-deps --ignore-installed -q "$TORCH_PIN" >/dev/null 2>&1; then
  echo "SKIP: $TORCH_PIN (the local CPU torch wheel the SGLang venv is built on) is not available to pip here"
  exit "$SKIP_RC"
fi

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
echo "sglang-venv: building $VENV from $LOCK" >&2
"$VPY" -m pip install -q --no-deps -r "$LOCK" 2>&1 | quiet
"$VPY" - <<'PY'
# Guard torchvision's fake-kernel registrations (see the header); idempotent.
import pathlib, sysconfig
path = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta_registrations.py"
text = path.read_text()
marker = "# ems: guarded for a CPU torch\n"
if marker not in text:
    old = '@torch.library.register_fake("torchvision::'
    assert text.count(old) == 2, "torchvision's meta registrations changed: update the guard"
    new = '@(lambda f: f) if not torchvision.extension._has_ops() else ' + old[1:]
    text = marker + "import torchvision.extension\n" + text.replace(old, new)
    path.write_text(text)
PY
"$VPY" -c "import torch, torchvision, sglang; assert torch.__version__ == '2.13.0+cpu', torch.__version__" \
  || { echo "sglang-venv: sglang failed to import in $VENV" >&2; exit 1; }
lock_sha > "$STAMP"
link_ems
echo "sglang-venv: built $VENV in $(( $(date +%s) - start )) s" >&2
echo "$VPY"
