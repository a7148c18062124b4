"""The ``ems`` command: ``ems demo`` (the main job), ``ems bench``, ``ems stats``,
``ems tenants|keys|quota`` (ems-control), ``ems cluster``.

Each subcommand lives in its own package and is imported only when used, so
``ems --help`` works without torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

__all__ = ["main"]

_COMMANDS = {
    "demo": ("ems.demo", "main",
             "prefix caching in a real decoding loop: outputs with and without ems, time saved"),
    "bench": ("ems.bench", "main",
              "throughput and latency against memcpy and the peers (table, JSON, plot)"),
    "stats": ("ems.stats", "main",
              "counters of a running ems-server (capacity, used, hit rate, tenants)"),
    "tenants": ("ems.control.cli", "tenants_main",
                "tenants on ems-control: create, list, show, delete"),
    "keys": ("ems.control.cli", "keys_main",
             "access keys on ems-control: issue, list, rotate, revoke"),
    "quota": ("ems.control.cli", "quota_main", "quotas on ems-control: set"),
    "cluster": ("ems.cluster.launcher", "main",
                "a local Valkey Cluster for ems-server --cluster (up / down)"),
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ems", description="ems: a KV-cache memory pool for LLM inference.",
        epilog="Run 'ems COMMAND --help' for a command's options. The pool daemon is "
               "the separate 'ems-server' command.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("command", choices=sorted(_COMMANDS),
                        help="; ".join(f"{k}: {v[2]}" for k, v in sorted(_COMMANDS.items())))
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module_name, func_name, _ = _COMMANDS[ns.command]
    import importlib
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(ns.args) or 0)


if __name__ == "__main__":
    sys.exit(main())
