"""The pure cores of ``ems bench --trace``: a Mooncake-format trace, and the hit rates
a prefix cache of a given size would get on it (exact LRU, the offline optimum, the
infinite bound). No I/O but reading the trace file; no clock; deterministic.

A trace is JSONL, one request per line (``.xz`` compressed or not), as Mooncake's
FAST'25 traces are::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``hash_ids`` is the chain of the request's 512-token blocks; it is prefix-closed: an
id names a block *and its whole prefix*, so two requests that share an id share every
block before it. The cache is asked, per request, for the chain; a request's hits are
its **leading** blocks found (a prefix cache cannot use a block after a missing one),
so the hit rate is leading blocks found / blocks asked.

The engine's access pattern, which every simulation replays: per request, the leading
hits are loaded (each becomes most recently used, in chain order), then the rest of
the chain is saved after prefill (a block already stored is touched, a missing one is
inserted, evicting the least recently used block when the cache is full).

* :func:`lru` -- exact LRU (an ``OrderedDict``) of ``capacity`` blocks, in the order
  the pool itself observes a request: the leading hits become most recent in chain
  order (released after their load); then the save goes through the rest of the chain
  in order (``Pool.reserve``): a block already stored leaves the eviction order for the
  rest of the batch (it cannot be evicted by a later block of the same save), a missing
  one takes the space of the least recently used evictable block; at the end the
  stored ones come back most recent, in order, then the new ones (at commit), in order.
  A block the save reaches only after an earlier new block of the same save evicted it
  is a new block again. A save with nothing left to evict stores no more (the pool's
  ``FULL``; only when one chain is longer than the cache).
* :func:`belady` -- the offline optimum for prefix lookups. Every block access is
  numbered in trace order (request by request, chain order within a request); the
  next use of an access is the number of the next access of the same id (infinite if
  none). On a miss the block is inserted; when the cache holds more than ``capacity``
  blocks, the block whose next use is farthest is evicted, which may be the block just
  inserted (a bypass: the optimum need not keep what it fetches). This is Belady's
  MIN, which maximises the number of block hits of any policy (uniform sizes). Why it
  is also the optimum of *leading* hits: in a prefix-closed trace a block's parent (the
  id before it in a chain) is accessed just before it in every request that uses it,
  so the parent's next use is always strictly sooner than the child's, and MIN never
  keeps a child that has a future use while evicting its parent; so every block hit of
  MIN is a leading hit, and no policy's leading hits can exceed MIN's block hits.
* :func:`infinite` -- no eviction: a block hits if any earlier request used it.

Speed (the conversation trace: 12,031 requests, 288,500 block accesses, 182,790
distinct ids): LRU ~0.3 s, Belady ~0.7 s (precomputed next uses, a heap with lazy
deletion), here on one core.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import json
import lzma
from typing import IO, Iterable, NamedTuple, Optional, Sequence

from ems.errors import invalid

__all__ = ["SimResult", "Trace", "TraceRequest", "belady", "infinite", "load_trace",
           "lru", "parse_trace"]


class TraceRequest(NamedTuple):
    """One request of a trace: arrival (ms in Mooncake's traces), token counts, and the
    chain of its blocks' ids."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Trace:
    """The requests of a trace, in order."""

    requests: tuple[TraceRequest, ...]

    @property
    def blocks(self) -> int:
        """Block lookups: the sum of the chains' lengths."""
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def distinct(self) -> int:
        """Distinct block ids."""
        return len({h for r in self.requests for h in r.hash_ids})

    @property
    def longest(self) -> int:
        """The longest chain (blocks)."""
        return max((len(r.hash_ids) for r in self.requests), default=0)

    def head(self, n: Optional[int]) -> "Trace":
        """The first ``n`` requests (all of them for None)."""
        return self if n is None else Trace(self.requests[:n])


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What a simulated cache of ``capacity`` blocks got on a trace."""

    capacity: Optional[int]  # None: infinite
    hits: int  # leading blocks found
    blocks: int  # blocks asked

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


_FIELDS = ("timestamp", "input_length", "output_length")


def parse_trace(lines: Iterable[str], name: str = "trace") -> Trace:
    """Requests from JSONL lines (blank lines skipped). A line that is not a JSON
    object, or lacks a field, or has a field of the wrong type, raises
    ``EMS_INVALID_ARGUMENT`` naming the line and the field."""
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise invalid(f"{name} line {no}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise invalid(f"{name} line {no}: must be a JSON object, got "
                          f"{type(obj).__name__}")
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(
                type(h) is int and h >= 0 for h in ids):
            raise invalid(f"{name} line {no}: hash_ids must be a list of integers >= 0")
        if len(set(ids)) != len(ids):
            raise invalid(f"{name} line {no}: hash_ids must not repeat an id in one chain")
        nums = []
        for field in _FIELDS:
            v = obj.get(field, 0)
            if type(v) is not int or v < 0:
                raise invalid(f"{name} line {no}: {field} must be an integer >= 0, "
                              f"got {v!r}")
            nums.append(v)
        out.append(TraceRequest(nums[0], nums[1], nums[2], tuple(ids)))
    return Trace(tuple(out))


def load_trace(path: str) -> Trace:
    """A trace file (``.xz`` decompressed on the fly)."""
    f: IO[str]
    try:
        f = lzma.open(path, "rt") if path.endswith(".xz") else open(path)
    except OSError as exc:
        raise invalid(f"trace {path}: {exc.strerror or exc}") from None
    with f:
        try:
            return parse_trace(f, path)
        except (OSError, EOFError, lzma.LZMAError) as exc:
            raise invalid(f"trace {path}: cannot read it ({exc})") from None


def _leading(found: Sequence[bool]) -> int:
    n = 0
    for hit in found:
        if not hit:
            break
        n += 1
    return n


def lru(trace: Trace, capacity: int) -> SimResult:
    """Exact LRU of ``capacity`` blocks, in the pool's order (module docstring)."""
    if capacity < 1:
        raise invalid(f"capacity must be >= 1 block, got {capacity}")
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    touch = cache.move_to_end
    hits = blocks = 0
    for r in trace.requests:
        ids = r.hash_ids
        blocks += len(ids)
        lead = 0
        for h in ids:
            if h not in cache:
                break
            lead += 1
        hits += lead
        for h in ids[:lead]:  # loaded
            touch(h)
        held: list[int] = []  # stored blocks of the save, out of the order meanwhile
        new: list[int] = []  # reserved blocks of the save
        for h in ids[lead:]:
            if h in cache:
                del cache[h]
                held.append(h)
                continue
            while cache and len(cache) + len(held) + len(new) >= capacity:
                cache.popitem(last=False)
            if len(cache) + len(held) + len(new) < capacity:
                new.append(h)
        for h in held:
            cache[h] = None
        for h in new:
            cache[h] = None
    return SimResult(capacity, hits, blocks)


def belady(trace: Trace, capacity: int) -> SimResult:
    """The offline optimum for prefix lookups of ``capacity`` blocks (module
    docstring): evict the block whose next use is farthest, bypass allowed."""
    if capacity < 1:
        raise invalid(f"capacity must be >= 1 block, got {capacity}")
    flat = [h for r in trace.requests for h in r.hash_ids]
    n = len(flat)
    nxt = [0] * n
    seen: dict[int, int] = {}
    for t in range(n - 1, -1, -1):
        h = flat[t]
        # never used again: a distinct "infinity" per access, so that the heap's
        # order is total and a cached id's value identifies its live heap entry
        nxt[t] = seen.get(h, n + t)
        seen[h] = t
    cache: dict[int, int] = {}  # id -> the next use of its latest access
    heap: list[tuple[int, int]] = []  # (-next use, id), lazily deleted
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    t = 0
    for r in trace.requests:
        leading = True
        for h in r.hash_ids:
            if h in cache:
                if leading:
                    hits += 1
            else:
                leading = False
            cache[h] = nxt[t]
            push(heap, (-nxt[t], h))
            if len(cache) > capacity:
                while True:
                    neg, victim = pop(heap)
                    if cache.get(victim) == -neg:
                        del cache[victim]
                        break
            t += 1
    return SimResult(capacity, hits, n)


def infinite(trace: Trace) -> SimResult:
    """No eviction: the most any cache can hit."""
    seen: set[int] = set()
    hits = blocks = 0
    for r in trace.requests:
        blocks += len(r.hash_ids)
        hits += _leading([h in seen for h in r.hash_ids])
        seen.update(r.hash_ids)
    return SimResult(None, hits, blocks)
