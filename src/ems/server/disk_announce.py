"""The disk's engine block hashes across a restart, so that KV events can announce what
recovery found (``disk.announce_recovered``).

A disk record holds its tenant, its storage key and its value; the engine's block hash
that a KV-aware router matches came with the save and lives only in the KV events
publisher's memory (``ems.server.kv_events``). So the disk tier keeps a side file,
``DIR/kv-hashes``: for each tenant the keys the publisher knows on the disk, as the
XXH3-64 of the key and the engine's hash, written at every checkpoint interval in
which the disk stored or removed something and at a clean stop (a temporary file,
fsynced, renamed over the old one, the directory fsynced: the file is the old one or
the new one, never a mix; a million keys take 0.5 s of CPU to encode). After a restart::

    AllBlocksCleared (the publisher, at start)
      -> recovery of the disk (its own thread)
      -> for each recovered key whose digest the side file names:
         BlockStored(ems-disk) of its hash, in chunks; the publisher tracks it again,
         so its later eviction from the disk is a BlockRemoved
      -> the side file rewritten every checkpoint interval from then on

What it cannot announce: a record written after the last side file (a crash between
two intervals; a clean stop writes it last), and a key the publisher had forgotten
(it tracks ``max_tracked_keys``, the oldest first). A record the side file names but
recovery did not find (evicted, damaged) is not announced: only what the disk holds.
16 bytes per key: a million keys are a 16 MiB file. A damaged or foreign file is
ignored as a whole (nothing announced, one warning).

Pure encoding here, plus the atomic write; the disk tier runs it (``ems.server.
disk_tier``).
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from typing import Mapping, Optional, Sequence

import xxhash

__all__ = ["FILE", "decode", "encode", "key_digest", "load", "save"]

logger = logging.getLogger(__name__)

FILE = "kv-hashes"
_MAGIC = b"EMSKVH01"
_HEAD = struct.Struct("<8sI")  # magic, tenants
_TENANT = struct.Struct("<HQ")  # name length, keys


def key_digest(key: str) -> int:
    """What the side file keeps of a storage key (XXH3-64 of its UTF-8)."""
    return int(xxhash.xxh3_64_intdigest(key.encode()))


def encode(rows: Mapping[str, Sequence[tuple[str, int]]]) -> bytes:
    """The side file of ``rows`` (tenant -> (key, engine hash) pairs), checksummed."""
    out = bytearray(_HEAD.pack(_MAGIC, len(rows)))
    for tenant, pairs in rows.items():
        name = tenant.encode()
        out += _TENANT.pack(len(name), len(pairs)) + name
        out += array("Q", [key_digest(k) for k, _ in pairs]).tobytes()
        out += array("Q", [h & 0xFFFF_FFFF_FFFF_FFFF for _, h in pairs]).tobytes()
    out += struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(out)))
    return bytes(out)


def decode(data: bytes) -> Optional[dict[str, dict[int, int]]]:
    """tenant -> {key digest: engine hash}, or None when ``data`` is not a whole,
    undamaged side file."""
    if len(data) < _HEAD.size + 8:
        return None
    (want,) = struct.unpack_from("<Q", data, len(data) - 8)
    if xxhash.xxh3_64_intdigest(data[:-8]) != want:
        return None
    try:
        magic, tenants = _HEAD.unpack_from(data, 0)
        if magic != _MAGIC:
            return None
        at = _HEAD.size
        out: dict[str, dict[int, int]] = {}
        for _ in range(tenants):
            nl, n = _TENANT.unpack_from(data, at)
            at += _TENANT.size
            tenant = data[at:at + nl].decode()
            at += nl
            digests, hashes = array("Q"), array("Q")
            digests.frombytes(data[at:at + 8 * n])
            hashes.frombytes(data[at + 8 * n:at + 16 * n])
            if len(digests) != n or len(hashes) != n:
                return None
            at += 16 * n
            out[tenant] = dict(zip(digests, hashes))
    except (struct.error, UnicodeDecodeError):
        return None
    return out if at == len(data) - 8 else None


def save(root: str, rows: Mapping[str, Sequence[tuple[str, int]]]) -> None:
    """Replace ``root``'s side file by ``rows``, atomically and durably; raises
    OSError."""
    path = os.path.join(root, FILE)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, encode(rows))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def load(root: str) -> dict[str, dict[int, int]]:
    """The side file of ``root`` (empty when there is none or it is damaged)."""
    try:
        with open(os.path.join(root, FILE), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        logger.warning("ems disk: cannot read %s (%s): recovered records not announced",
                       os.path.join(root, FILE), exc)
        return {}
    got = decode(data)
    if got is None:
        logger.warning("ems disk: %s is damaged: recovered records not announced",
                       os.path.join(root, FILE))
        return {}
    return got
