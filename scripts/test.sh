#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up (with test dependencies), then
# run pytest (unit + integration; integration tests start and stop their own
# ems-server daemons in temp dirs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec "${PYTHON:-python3}" -m pytest -p no:cacheprovider "$@"
