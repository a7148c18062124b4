"""``ems bench``: throughput and latency of ems against memcpy, Mooncake Store and Redis,
measured side by side in one run, with a table, JSON and a plot. See
:mod:`ems.bench.runner` for the command line."""

from ems.bench.runner import main

__all__ = ["main"]
