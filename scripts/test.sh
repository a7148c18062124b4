#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up (with test dependencies), lint
# (ruff) and type-check (mypy), the packaging check (sdist + wheel, twine, a fresh
# virtualenv; scripts/package-check.sh), then pytest (unit, integration and the fault suite; those start and stop their own ems-server daemons
# in temp dirs). Any error fails the run. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/setup.sh test
"$PY" -m ruff check src tests benchmarks examples
"$PY" -m mypy
bash scripts/package-check.sh
exec "$PY" -m pytest -p no:cacheprovider "$@"
