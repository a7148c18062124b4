"""Cluster keys: the Valkey key of a stored value, and the hash slot it lands in.

Every value of the shared tier is stored under::

    ems:{<tenant>/<distribute_key>}:<attribute_key>

Valkey Cluster hashes only what is between the first ``{`` and the next ``}`` (the
hash tag), so every key with the same tenant and distribute key is in one slot, hence
on one node: EMS's "same distribute_key, same node". The user's parts are escaped
(``%`` -> ``%25``, ``{`` -> ``%7B``, ``}`` -> ``%7D``; ``/`` -> ``%2F`` in the tenant;
``:`` -> ``%3A`` in V0 parts), so the tag is exactly tenant + distribute key whatever
the user's key holds, and two different (tenant, distribute key, attribute key) never
meet in one name (a V1 block's distribute key holds raw ``:``, no V0 key does).

Which distribute key a storage key (``ems.keys``) has:

* V0 ``PrimaryKey(d, a)`` (storage key ``v0:p:<len(d)>:<d><a>``): ``d``, attribute ``a``;
* V0 plain ``str`` key ``k`` (``v0:s:<k>``): ``k`` is its own distribute key, no
  attribute;
* V1 block (``v1:<prefix>:<hash>``): the block's own storage key. The blocks of one
  prefix spread over every node, so a load of a long prefix pipelines to all nodes in
  parallel instead of queueing on one: measured (``benchmarks/cluster_bench.py``,
  docs/tiers/cluster.md), the busiest of 3 nodes serves 36-38% of a 48-block prefix spread,
  100% tagged, and one node's stream is capped by one valkey thread and one NIC; a hot
  prefix then does not make one node the fleet's hot spot. (On one 2-vCPU host, where
  all nodes share the cores, the two schemes' throughputs are equal within noise.)

The slot is CRC16/XMODEM of the tag modulo 16384, as Redis Cluster and Valkey define
it (unit-tested against ``CLUSTER KEYSLOT`` of a real server).
"""

from __future__ import annotations

import binascii

__all__ = ["SLOTS", "cluster_key", "hash_slot", "split_storage_key", "escape"]

SLOTS = 16384


def crc16(data: bytes) -> int:
    """CRC16/XMODEM (poly 0x1021, init 0), the checksum of Redis Cluster's key slots:
    ``binascii.crc_hqx`` with init 0 is exactly that, in C (~0.1 us against ~10 us for
    a table loop in Python over a 60-byte key)."""
    return binascii.crc_hqx(data, 0)


def hash_slot(key: bytes) -> int:
    """The slot of ``key``: of its hash tag when it has a non-empty one, else of it all."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return crc16(key) % SLOTS


_ESCAPES = (("%", "%25"), ("{", "%7B"), ("}", "%7D"), ("/", "%2F"), (":", "%3A"))


def escape(text: str, also: str = "") -> str:
    """``text`` with ``%``, ``{``, ``}`` and the characters of ``also`` (``/``, ``:``)
    percent-encoded."""
    for char, code in _ESCAPES:
        if (char in "%{}" or char in also) and char in text:
            text = text.replace(char, code)
    return text


def split_storage_key(storage_key: str) -> tuple[str, str]:
    """(distribute key, attribute key) of a storage key of ``ems.keys`` (see the module
    docstring); a key of no known form is its own distribute key."""
    if storage_key.startswith("v0:p:"):
        length, sep, rest = storage_key[5:].partition(":")
        if sep and length.isdigit() and int(length) <= len(rest):
            n = int(length)
            return rest[:n], rest[n:]
    elif storage_key.startswith("v0:s:"):
        return storage_key[5:], ""
    return storage_key, ""


def cluster_key(tenant: str, storage_key: str) -> bytes:
    """The Valkey key of ``storage_key`` of ``tenant`` (UTF-8 bytes)."""
    distribute, attribute = split_storage_key(storage_key)
    if storage_key.startswith("v0:"):
        distribute, attribute = escape(distribute, ":"), escape(attribute, ":")
    else:
        distribute, attribute = escape(distribute), escape(attribute)
    return f"ems:{{{escape(tenant, '/')}/{distribute}}}:{attribute}".encode()
