"""A small synthetic trace shaped like Mooncake's (prefix-shared chains of block hashes,
one-hit blocks, a hot set), the exact LRU simulation of a byte capacity, and a replay
of a trace on ``ems.pool.Pool`` as a prefix-caching engine uses a pool.

Per request, as an engine does: ``exists`` of the chain counts the leading blocks
present, those are loaded (acquire, then release), the missing ones are saved (one
reserve of all of them, then commit). A request's hit rate counts the leading blocks
found over the blocks asked.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

from ems.bench.trace_sim import Trace, TraceRequest, lru
from ems.pool import GrantStatus, Pool

__all__ = ["ReplayResult", "lru_hit_rate", "replay_pool", "synthetic_trace"]


def synthetic_trace(requests: int, seed: int = 0) -> list[list[int]]:
    """``requests`` chains of block hashes: a hot set of shared prefixes (Zipf-like
    popularity), conversations whose next turn extends their own chain, and unique
    tail blocks that are never asked for again."""
    rng = random.Random(seed)
    ids = itertools.count(1)
    prefixes = [[next(ids) for _ in range(rng.randint(2, 10))] for _ in range(60)]
    conversations: list[list[int]] = []
    trace = []
    for _ in range(requests):
        if conversations and rng.random() < 0.35:  # the next turn of a conversation
            chain = rng.choice(conversations)
            chain.extend(next(ids) for _ in range(rng.randint(1, 4)))
        else:
            rank = min(int(rng.paretovariate(1.1)), len(prefixes)) - 1
            chain = prefixes[rank] + [next(ids) for _ in range(rng.randint(1, 8))]
            conversations.append(chain)
            if len(conversations) > 80:
                conversations.pop(rng.randrange(len(conversations)))
        trace.append(list(chain[:48]))
    return trace


def lru_hit_rate(trace: list[list[int]], capacity_blocks: int) -> float:
    """The exact LRU cache of ``capacity_blocks`` blocks, in the pool's own order within
    a request: the benchmark's simulation (``ems.bench.trace_sim.lru``), not a twin."""
    requests = tuple(TraceRequest(0, 0, 0, tuple(chain)) for chain in trace)
    return lru(Trace(requests), capacity_blocks).hit_rate


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    hit_rate: float
    #: live bytes over the pool's capacity at the end
    fill: float
    evictions_fragmentation: int


def replay_pool(pool: Pool, trace: list[list[int]], block_bytes: int) -> ReplayResult:
    """Replay ``trace`` on ``pool`` (one owner), every block ``block_bytes``."""
    hits = asked = 0
    for chain in trace:
        keys = [f"b{h}" for h in chain]
        asked += len(keys)
        n = pool.exists(keys)
        pins = pool.acquire(keys[:n], owner="engine")
        assert len(pins) == n, "exists then load disagree"
        hits += n
        pool.release([p.token for p in pins], owner="engine")
        if n < len(keys):
            grants = pool.reserve(keys[n:], [block_bytes] * (len(keys) - n), owner="engine")
            pool.commit([g.token for g in grants if g.status is GrantStatus.NEW],
                        owner="engine")
    stats = pool.statistics()
    return ReplayResult(hits / asked if asked else 0.0,
                        stats.live_bytes / stats.capacity_bytes, stats.evictions_fragmentation)
