"""``ems-server``: the per-host pool daemon (one per host, shared by every inference
process on it).

Run it with ``ems-server`` (or ``python -m ems.server``); ``ems-server stats`` prints
its counters. The daemon owns one pool per tenant, keeps only control messages on its
unix socket, and hands each tenant's memory to that tenant's processes as a memfd;
see ``ems.server.config`` for every setting and ``ems.server.daemon`` for the loop.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["stats_main"]


def stats_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ems stats`` / ``ems-server stats``: print the daemon's counters; returns the
    exit status (0, or 1 when no daemon answers)."""
    from ems.server.stats import main
    return main(argv)
