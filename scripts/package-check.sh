#!/usr/bin/env bash
# The packaging check (part of scripts/test.sh): build the sdist and, from it, the
# wheel (`python -m build`: the native copy helper compiles from the sdist), check both
# with `twine check`, install the wheel into a fresh virtualenv with the README's
# install line, and there import ems and run examples/quickstart.py on the embedded
# pool and on an `ems-server` started from the venv. Then build a wheel from the same
# sdist with the C compiler failing (CC=false): the build must succeed without
# `ems._native`, and the example must run on the fallback copy.
#   bash scripts/package-check.sh          # ~30 s; nothing is left behind
# --no-isolation: the build backend (setuptools) comes from this environment, not a
# fresh download per run; `pip install -e .` already requires the same setuptools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DIST=ems-kvpool
VERSION=$(PYTHONPATH=src "$PY" -c "from ems._version import __version__; print(__version__)")
tmp=$(mktemp -d)
server=""
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
step() { echo "package-check: $*"; }
fail() { echo "package-check: FAILED: $*" >&2; exit 1; }
quiet() { grep -v -e "Running pip as the 'root' user" -e "is ignored: it is neither" || true; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

step "build $DIST $VERSION (sdist, then the wheel from the sdist)"
"$PY" -m build --no-isolation --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log"; fail "python -m build"; }
sdist=$(ls "$tmp"/dist/ems_kvpool-"$VERSION".tar.gz) || fail "no sdist named for $VERSION"
wheel=$(ls "$tmp"/dist/ems_kvpool-"$VERSION"-*.whl) || fail "no wheel named for $VERSION"
"$PY" -m twine check --strict "$sdist" "$wheel" || fail "twine check"
"$PY" - "$wheel" "$sdist" <<'PYEOF' || fail "the distribution's contents"
import sys, tarfile, zipfile
wheel, sdist = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
need = ["ems/__init__.py", "ems/py.typed", "ems/control/static/index.html"]
missing = [n for n in need if n not in names]
assert not missing, f"wheel lacks {missing}"
assert any(n.startswith("ems/_native") and n.endswith(".so") for n in names), \
    "the wheel has no ems/_native*.so (the native helper did not build from the sdist)"
assert not any(n.startswith(("tests/", "benchmarks/")) for n in names), "tests in the wheel"
members = tarfile.open(sdist).getnames()
assert any(m.endswith("src/ems/_native.c") for m in members), "the sdist lacks _native.c"
print(f"package-check: wheel: {len(names)} files, with the native helper")
PYEOF

step "install into a fresh virtualenv: pip install $DIST (from the built wheel)"
"$PY" -m venv "$tmp/venv"
VPY="$tmp/venv/bin/python"
( cd "$tmp" && env -u PYTHONPATH "$VPY" -m pip install -q --find-links "$tmp/dist" \
    "$DIST==$VERSION" 2>&1 | quiet )
run_venv() { ( cd "$tmp" && exec env -u PYTHONPATH -u EMS_SOCKET_DIR -u EMS_POOL "$@" ); }
run_venv "$VPY" -c "
import ems, ems.client.native as n, sys
assert ems.__file__.startswith(sys.prefix), ems.__file__
assert ems.__version__ == '$VERSION', ems.__version__
assert n.available(), 'the native helper did not load'
print('package-check: import ems', ems.__version__, 'from', ems.__file__)"
expect() {  # the quickstart's three lines
  grep -qx "saved: CcResult(success=2, total=2)" "$1" &&
    grep -qx "loaded: CcResult(success=2, total=2)" "$1" &&
    grep -qx "bytes equal: True" "$1" || { cat "$1"; fail "$2"; }
}
run_venv env EMS_POOL=embedded EMS_CAPACITY=64M "$VPY" "$PWD/examples/quickstart.py" \
  >"$tmp/embedded.out" 2>&1 || { cat "$tmp/embedded.out"; fail "the example (embedded)"; }
expect "$tmp/embedded.out" "the example (embedded)"

step "ems-server from the venv, the example through it"
mkdir -p "$tmp/sock"
env -u PYTHONPATH "$tmp/venv/bin/ems-server" --socket-dir "$tmp/sock" --capacity 64M \
  >"$tmp/server.log" 2>&1 &
server=$!
for _ in $(seq 100); do [ -S "$tmp/sock/ems.sock" ] && break; sleep 0.1; done
[ -S "$tmp/sock/ems.sock" ] || { cat "$tmp/server.log"; fail "ems-server did not start"; }
run_venv env EMS_POOL=server EMS_SOCKET_DIR="$tmp/sock" "$VPY" "$PWD/examples/quickstart.py" \
  >"$tmp/server.out" 2>&1 || { cat "$tmp/server.out"; fail "the example (ems-server)"; }
expect "$tmp/server.out" "the example (ems-server)"
kill -TERM "$server"
rc=0; wait "$server" || rc=$?
server=""
[ "$rc" = 0 ] || { cat "$tmp/server.log"; fail "ems-server exited $rc after SIGTERM"; }

step "the sdist without a C compiler (CC=false): builds, falls back to the plain copy"
CC=false "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/nocc" "$sdist" \
  >"$tmp/nocc.log" 2>&1 || { cat "$tmp/nocc.log"; fail "the sdist did not build without a compiler"; }
nocc=$(ls "$tmp"/nocc/ems_kvpool-"$VERSION"-*.whl)
"$PY" -c "
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert not any(n.startswith('ems/_native') and n.endswith('.so') for n in names), names
" "$nocc" || fail "a wheel built with CC=false holds a native helper"
( cd "$tmp" && env -u PYTHONPATH "$VPY" -m pip install -q --no-deps --force-reinstall "$nocc" 2>&1 | quiet )
run_venv "$VPY" -c "
import ems.client.native as n
assert not n.available(), 'the native helper is there without a compiler'"
run_venv env EMS_POOL=embedded EMS_CAPACITY=64M "$VPY" "$PWD/examples/quickstart.py" \
  >"$tmp/nocc.out" 2>&1 || { cat "$tmp/nocc.out"; fail "the example without the native helper"; }
expect "$tmp/nocc.out" "the example without the native helper"
step "OK ($DIST $VERSION: sdist, wheel, twine, fresh venv, embedded + daemon, no-compiler fallback)"
