"""Block keys that do not depend on how vLLM hashes (no vLLM import).

vLLM's own block hashes start their chain from ``NONE_HASH``, which comes from
``PYTHONHASHSEED`` when it is set, from a fixed string for sha256, and from fresh
random bytes per process for the xxhash algorithms. Keys taken from them would differ
between engines whose environment differs, and after every restart under xxhash. So
ems chains its own digest over what makes a block's KV what it is::

    D[-1] = sha256(b"ems.vllm.block.v1")
    D[i]  = sha256(D[i-1] || tokens of block i (int64 little-endian) ||
                   canonical(extra keys of block i))

The extra keys are vLLM's (``generate_block_hash_extra_keys``: the LoRA name and
path, multimodal hashes and offsets, the cache salt on the first block, prompt
embedding digests), so requests that vLLM keeps apart stay apart; the model, the
engine, the parallel ranks and the cache layout are in the SDK's key prefix. Nothing
else goes in: the same tokens give the same keys in every process, restart and host,
and on the scheduler and the worker.

A pool key is 64 bits: :func:`key_of` (the digest's first 8 bytes). The whole
32-byte digest is the block's *identity*: the connector stores it with the block (a
page of its own in the pool object) and compares it after a load, so two prefixes
whose keys collide are a miss, never the wrong KV.

:func:`event_hash` is what vLLM publishes for a block in its KV events (the low 64
bits of its block hash, unsigned): ems's events carry that, so routers that read
vLLM's events match ems's against them.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence

__all__ = ["IDENTITY_BYTES", "ROOT", "block_digest", "canonical", "event_hash", "key_of"]

#: the digest before the first block
ROOT = hashlib.sha256(b"ems.vllm.block.v1").digest()
#: bytes of a block's identity (its digest)
IDENTITY_BYTES = 32
_U64 = (1 << 64) - 1


def canonical(value: Any) -> bytes:
    """One byte string per value of the types vLLM's extra keys are made of (None,
    bool, int, str, bytes, tuples and lists of them), the same in every process:
    a type tag and a length before each part, so no two values share an encoding.
    Anything else raises ``TypeError`` (the connector then caches nothing for the
    request rather than guess)."""
    out = bytearray()
    _put(out, value)
    return bytes(out)


def _put(out: bytearray, v: Any) -> None:
    if v is None:
        out += b"N"
    elif v is True or v is False:
        out += b"T" if v else b"F"
    elif type(v) is int:
        raw = str(v).encode()
        out += b"i" + struct.pack("<I", len(raw)) + raw
    elif type(v) is str:
        raw = v.encode("utf-8", "surrogatepass")
        out += b"s" + struct.pack("<I", len(raw)) + raw
    elif type(v) in (bytes, bytearray):
        out += b"b" + struct.pack("<I", len(v)) + bytes(v)
    elif type(v) in (tuple, list):
        out += b"(" + struct.pack("<I", len(v))
        for x in v:
            _put(out, x)
    else:
        raise TypeError(f"a block's extra key of type {type(v).__name__} has no "
                        f"canonical form")


def block_digest(parent: bytes, tokens: Sequence[int], extra: Any) -> bytes:
    """The digest of a block from its parent's digest (:data:`ROOT` for the first),
    its token ids and its extra keys (None or a tuple)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update(canonical(extra))
    return h.digest()


def key_of(digest: bytes) -> int:
    """A block's pool key: the first 8 bytes of its digest as a signed 64-bit int."""
    return int.from_bytes(digest[:8], "little", signed=True)


def event_hash(block_hash: Any) -> int:
    """What vLLM publishes for a block hash in its KV events: the low 64 bits of the
    hash bytes read big-endian, unsigned (an int hash: its low 64 bits)."""
    if isinstance(block_hash, int):
        return block_hash & _U64
    return int.from_bytes(bytes(block_hash), "big") & _U64
