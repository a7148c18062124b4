"""``ems-server``: the per-host pool daemon (one per host, shared by every inference
process on it).

Run it with ``ems-server`` (or ``python -m ems.server``); ``ems-server stats`` prints
its counters (``ems.stats``, a client of the daemon). The daemon owns one pool per
tenant, keeps only control messages on its unix socket, and hands each tenant's memory
to that tenant's processes as a memfd;
see ``ems.server.config`` for every setting and ``ems.server.daemon`` for the loop.
"""

from __future__ import annotations

__all__: list[str] = []
