#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up (with test dependencies), lint
# (ruff) and type-check (mypy), the packaging check (sdist + wheel, twine, a fresh
# virtualenv; scripts/package-check.sh), the docs site (the benchmark page's tables
# and the test timings against their JSON, the settings tables against their
# declarations, then `mkdocs build --strict`: a broken link or a page missing from
# the nav fails it), then pytest (unit,
# integration and the fault suite; those start and stop their own ems-server daemons
# in temp dirs), all of it: --run-slow includes the tests a plain `pytest` leaves out
# (marked slow or engine). Any error fails the run. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/setup.sh test
"$PY" -m ruff check src tests benchmarks examples scripts
"$PY" -m mypy
bash scripts/package-check.sh
"$PY" scripts/bench_tables.py --check
"$PY" scripts/test_durations.py --check
"$PY" scripts/settings_tables.py --check
# not --quiet: it hides the warnings that --strict counts, and the build then passes
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --site-dir "$site" >"$site.log" 2>&1 ||
  { cat "$site.log"; rm -rf "$site" "$site.log"; exit 1; }
rm -rf "$site" "$site.log"
echo "docs: mkdocs build --strict passed"
exec "$PY" -m pytest -p no:cacheprovider --run-slow "$@"
