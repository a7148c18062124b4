#!/usr/bin/env python3
"""The same as ``ems bench`` (for a checkout without the console script installed).

    bash benchmarks/setup-peers.sh
    python benchmarks/bench.py --quick
    python benchmarks/bench.py --out docs      # docs/bench.json and bench.png, then
    python scripts/bench_tables.py             # the tables of docs/benchmarks.md
"""

import sys

from ems.bench import main

if __name__ == "__main__":  # the bench spawns worker processes: keep this guard
    sys.exit(main(sys.argv[1:]))
