"""The engine's side of the EMS V1 API: look up, load and save paged KV blocks.

This is what a KV connector in an inference engine does with ``ems`` (vLLM's
``KVConnectorBase_V1`` and the EMS adaptors of MindIE are built the same way):

* once, after the engine has allocated its paged KV cache, ``register_kvcache``;
* before a prefill, ``exists`` on the prompt's leading block hashes, then ``load``
  of the blocks found into the request's freshly allocated blocks, via the V1
  ``slot_mapping`` semantics (one slot per token, ``offsets`` of one block each);
  ``CcResult.success`` is the number of leading blocks actually loaded, and only
  those count: the engine recomputes the rest, overwriting whatever a partial
  load left in the later blocks;
* after the prefill, ``async_save`` of the full blocks it computed, and the
  future collected before those blocks are freed (a save reads the engine's KV
  cache in the background, so freeing earlier could save another request's KV).

A failure of the pool must never fail inference: every ``EmsException`` is logged
and the request simply runs without the cache, as real clients do.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from ems import CcKvOption, EmsException
from ems.demo.scheduler import slot_mapping

__all__ = ["ConnectorStats", "EmsConnector"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ConnectorStats:
    """What the connector moved, in blocks and seconds."""

    blocks_looked_up: int = 0
    blocks_found: int = 0
    blocks_loaded: int = 0
    blocks_saved: int = 0
    blocks_save_failed: int = 0
    errors: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0
    save_wait_s: float = 0.0


class EmsConnector:
    """Moves whole KV blocks between a registered paged cache and the pool.

    ``cc`` is the ``ContextCaching`` object of ``Ems.get_cc()``. Saves are
    asynchronous and tracked per request; :meth:`wait_saves` collects them.
    """

    def __init__(self, cc: Any, block_size: int, timeout_ms: int = 5000) -> None:
        self.cc = cc
        self.block_size = block_size
        self.timeout_ms = timeout_ms
        self.stats = ConnectorStats()
        self._pending: dict[str, list[tuple[Any, int]]] = {}

    def _option(self) -> CcKvOption:
        return CcKvOption(timeout=self.timeout_ms)

    def register(self, kv_caches: list[list[Any]]) -> None:
        """``cc.register_kvcache``: per layer ``[k, v]`` of the engine's paged cache."""
        self.cc.register_kvcache(kv_caches)

    def _args(self, block_table: Sequence[int], first_block: int,
              count: int) -> tuple[list[int], list[int]]:
        """``slot_mapping`` and ``offsets`` of ``count`` whole blocks of a block table."""
        slots = slot_mapping(block_table, self.block_size, first_block, count)
        return slots, [self.block_size] * count

    def load(self, hashes: Sequence[int], block_table: Sequence[int]) -> int:
        """Load the leading cached blocks of ``hashes`` into ``block_table``'s blocks.

        Asks the pool first how many leading blocks it holds (``exists``: nothing
        is copied for a miss), then loads those. Returns how many leading blocks
        are now valid in the cache; 0 on any pool error.
        """
        if not hashes:
            return 0
        stats = self.stats
        stats.blocks_looked_up += len(hashes)
        t0 = time.perf_counter()
        try:
            found = self.cc.exists(list(hashes)).success
        except EmsException as exc:
            stats.errors += 1
            logger.warning("ems exists failed (%s), prefilling without cache: %s",
                           exc.status_code().name, exc.message())
            return 0
        finally:
            stats.lookup_s += time.perf_counter() - t0
        stats.blocks_found += found
        if found == 0:
            return 0
        slots, offsets = self._args(block_table, 0, found)
        t0 = time.perf_counter()
        try:
            result = self.cc.load(slot_mapping=slots, hashes=list(hashes[:found]),
                                  offsets=offsets, option=self._option())
        except EmsException as exc:
            stats.errors += 1
            logger.warning("ems load failed (%s), prefilling without cache: %s",
                           exc.status_code().name, exc.message())
            return 0
        finally:
            stats.load_s += time.perf_counter() - t0
        if result.success < found:
            logger.info("ems load got %d of %d blocks found by exists", result.success, found)
        stats.blocks_loaded += result.success
        return result.success

    def save_async(self, request_id: str, hashes: Sequence[int],
                   block_table: Sequence[int], first_block: int) -> None:
        """Start saving blocks ``first_block ..`` (named ``hashes``) of a request."""
        if not hashes:
            return
        slots, offsets = self._args(block_table, first_block, len(hashes))
        try:
            future = self.cc.async_save(slot_mapping=slots, hashes=list(hashes),
                                        offsets=offsets, option=self._option())
        except EmsException as exc:
            self.stats.errors += 1
            self.stats.blocks_save_failed += len(hashes)
            logger.warning("ems async_save refused (%s): %s",
                           exc.status_code().name, exc.message())
            return
        self._pending.setdefault(request_id, []).append((future, len(hashes)))

    def wait_saves(self, request_id: str) -> int:
        """Wait for the request's saves (before its blocks are freed); blocks saved."""
        saved = 0
        t0 = time.perf_counter()
        for future, count in self._pending.pop(request_id, []):
            try:
                done = future.result().success
            except EmsException as exc:
                self.stats.errors += 1
                logger.warning("ems save failed (%s): %s",
                               exc.status_code().name, exc.message())
                done = 0
            saved += done
            self.stats.blocks_save_failed += count - done
        self.stats.save_wait_s += time.perf_counter() - t0
        self.stats.blocks_saved += saved
        return saved

    def wait_all(self) -> None:
        """Collect every outstanding save (at shutdown)."""
        for request_id in list(self._pending):
            self.wait_saves(request_id)
