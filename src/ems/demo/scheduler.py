"""Requests, KV blocks and block hashes: the engine-side bookkeeping of the demo.

A real inference engine (vLLM, SGLang, MindIE) owns a fixed pool of KV blocks on
the device, hands each running request the blocks it needs from a free list, and
takes them back when the request finishes. Prefix caching keys each *full* block
by a chained hash of its tokens: block ``i``'s hash covers its own token ids and
the hash of block ``i - 1``, so equal hashes mean equal prefixes and a cache hit
is only ever useful as a run of leading blocks. This module is that bookkeeping
and nothing else: no tensors are touched here.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from typing import Optional

__all__ = [
    "BlockAllocator",
    "NoFreeBlocks",
    "Request",
    "Scheduler",
    "block_hashes",
    "slot_mapping",
]


def block_hashes(token_ids: Sequence[int], block_size: int,
                 parent: Optional[int] = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``hash_i = blake2b(bytes(hash_{i-1}) + bytes(tokens of block i))`` taken as a
    signed 64-bit int, the type the V1 API expects. It is deterministic across
    processes and machines (no Python ``hash()``, fixed byte order), so one
    instance finds what another saved. ``parent`` seeds the chain (e.g. a hash of
    an adapter or a multimodal input); ``None`` starts from empty bytes.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes: list[int] = []
    prev = b"" if parent is None else struct.pack("<q", parent)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(prev + struct.pack(f"<{block_size}q", *block),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little", signed=True))
        prev = digest
    return hashes


def slot_mapping(block_table: Sequence[int], block_size: int,
                 first_block: int, num_blocks: int) -> list[int]:
    """Slots of every token of blocks ``[first_block, first_block + num_blocks)``.

    Slot = ``block_id * block_size + position_in_block``: the V1 ``slot_mapping``
    of whole blocks, ``offsets`` then being ``[block_size] * num_blocks``.
    """
    return [block_id * block_size + pos
            for block_id in block_table[first_block:first_block + num_blocks]
            for pos in range(block_size)]


class NoFreeBlocks(RuntimeError):
    """The allocator has fewer free blocks than a request asked for."""


class BlockAllocator:
    """A free list of KV block ids ``0 .. num_blocks - 1`` (first in, first out).

    FIFO reuse, like vLLM's free-block queue: a freed block goes to the back, so
    the block a request gets back soon is rarely the one it just gave up.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks off the free list; raise :class:`NoFreeBlocks` if short."""
        if count > len(self._free):
            raise NoFreeBlocks(f"asked for {count} blocks, {len(self._free)} free "
                               f"of {self.num_blocks}")
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: Sequence[int]) -> None:
        """Give blocks back (each must be held)."""
        self._free.extend(block_ids)


@dataclasses.dataclass
class Request:
    """One prompt to prefill and decode, and what the engine has done with it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    group: int = 0
    """Which shared prefix the prompt starts with (for the report only)."""
    block_table: list[int] = dataclasses.field(default_factory=list)
    output: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus tokens generated so far."""
        return len(self.prompt) + len(self.output)


class Scheduler:
    """Gives requests the blocks their tokens need and takes them back at the end.

    The demo runs one request at a time, so there is no batching policy to speak
    of; what matters is the block lifecycle a KV connector has to respect: blocks
    are allocated before a load writes into them, grow with decoding, and must not
    be freed while an asynchronous save still reads them.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def reserve(self, request: Request, num_tokens: int) -> list[int]:
        """Grow ``request``'s block table to hold ``num_tokens``; return the new block ids."""
        missing = self.blocks_for(num_tokens) - len(request.block_table)
        if missing <= 0:
            return []
        new = self.allocator.allocate(missing)
        request.block_table.extend(new)
        return new

    def finish(self, request: Request) -> list[int]:
        """Free ``request``'s blocks; return them (the caller may poison them)."""
        freed, request.block_table = request.block_table, []
        self.allocator.free(freed)
        return freed
