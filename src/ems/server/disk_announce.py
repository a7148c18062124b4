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

The format is pure (:func:`encode` / :func:`decode`); :class:`HashKeeper` is the
disk tier's thread that announces and keeps the file (``ems.server.disk_tier``).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from array import array
from typing import Mapping, Optional, Sequence

import xxhash

from ems.disk import DiskState, DiskStore
from ems.disk.io import LOCAL, FileSystem, read_file, replace_file
from ems.server.tiers import TierEvents

__all__ = ["FILE", "HashKeeper", "decode", "encode", "key_digest", "load", "save"]

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


def save(root: str, rows: Mapping[str, Sequence[tuple[str, int]]],
         fs: FileSystem = LOCAL) -> None:
    """Replace ``root``'s side file by ``rows``, atomically and durably
    (``ems.disk.io.replace_file``, as the checkpoint); raises OSError."""
    replace_file(fs, os.path.join(root, FILE), encode(rows))


def load(root: str, fs: FileSystem = LOCAL) -> dict[str, dict[int, int]]:
    """The side file of ``root`` (empty when there is none or it is damaged)."""
    path = os.path.join(root, FILE)
    try:
        data = read_file(fs, path)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        logger.warning("ems disk: cannot read %s (%s): recovered records not announced",
                       path, exc)
        return {}
    got = decode(data)
    if got is None:
        logger.warning("ems disk: %s is damaged: recovered records not announced", path)
        return {}
    return got


#: recovered records announced per event
ANNOUNCE_CHUNK = 4096


class HashKeeper:
    """The disk tier's side file, on a thread of its own (the module docstring)::

        wait for the store's recovery -> announce the recovered keys the file names
          -> every ``interval_s``: rewrite the file if the disk changed (:meth:`changed`)
        close(): stop; once announced, write the file a last time

    ``events``: KV events (the tier's ``TierEvents``); ``medium``: the disk's name
    there."""

    def __init__(self, store: DiskStore, root: str, events: TierEvents, medium: str,
                 interval_s: float) -> None:
        self.store, self.root, self.events, self.medium = store, root, events, medium
        self.interval_s = interval_s
        #: recovered records announced
        self.announced = 0
        # the disk's stores and removals told to KV events, and their number at the
        # last file: it is rewritten only when they changed (a million keys cost 0.5 s
        # of CPU to encode and 16 MB to write)
        self._changes = 0
        self._saved_at = -1
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="ems-disk-kv-hashes")
        self._thread.start()

    def changed(self) -> None:
        """The disk stored or removed keys (any thread; a lost increment of a race still
        changes the count)."""
        self._changes += 1

    def _run(self) -> None:
        store = self.store
        while not store.wait_recovered(1.0):
            if self._stop.is_set():
                return
        if store.state is not DiskState.OK:
            return
        known = load(self.root)
        for tenant, keys in store.keys().items() if known else ():
            digests = known.get(tenant)
            if not digests:
                continue
            found = [(k, h) for k in keys if (h := digests.get(key_digest(k))) is not None]
            for i in range(0, len(found), ANNOUNCE_CHUNK):
                if self._stop.is_set():
                    return  # stopped while announcing: the old file stays
                part = found[i:i + ANNOUNCE_CHUNK]
                self.events.tier_stored(tenant, [k for k, _ in part], self.medium,
                                        [h for _, h in part])
                self.announced += len(part)
        if self.announced:
            logger.info("ems disk: %d recovered records announced to KV events",
                        self.announced)
        self._done.set()
        while not self._stop.wait(self.interval_s):
            self._save()

    def _save(self) -> None:
        changes = self._changes  # (read once: a change racing this is saved next time)
        if changes == self._saved_at:
            return
        try:
            save(self.root, self.events.held(self.medium))
            self._saved_at = changes
        except OSError as exc:
            logger.warning("ems disk: cannot write %s (%s): a restart will not announce "
                           "the newest records", os.path.join(self.root, FILE), exc)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; write the file a last time if the announcement was over."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._done.is_set() and not self._thread.is_alive():
            self._save()
