#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the prefix-caching demo on the
# embedded pool (pass demo flags through, e.g. --requests 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m ems demo "$@"
