"""A prefix-caching engine's traffic through a real ``ems-server`` and the SDK (issue
26): the daemon's hit rate is at least the exact LRU simulation's of the same byte
capacity (leases no longer evict scattered objects), and a load right after an exists
of the same keys finds what the exists counted, also with the disk tier."""

from __future__ import annotations

import pytest
from support.client_worker import Value, pattern
from support.itest_support import anonymous_stats, wait_for
from support.kv_trace import lru_hit_rate, synthetic_trace

from ems import CcKvOption, Ems

pytestmark = pytest.mark.integration

BLOCK = 1024  # bytes per block: small, so a 2 MiB pool holds 2,048 blocks
OPTION = CcKvOption(timeout=5000)


def keys_of(chain: list[int]) -> list[str]:
    return [f"blk-{h}" for h in chain]


def save(cc, keys: list[str], size: int = BLOCK) -> int:
    values = [Value(size, pattern(k, size)) for k in keys]
    return cc.save(OPTION, keys, [v.wrappers() for v in values]).success


def load(cc, keys: list[str], size: int = BLOCK) -> tuple[int, int]:
    """(blocks loaded, blocks of them with wrong bytes)."""
    values = [Value(size) for _ in keys]
    got = cc.load(OPTION, keys, [v.wrappers() for v in values]).success
    return got, sum(1 for k, v in zip(keys[:got], values) if v.bytes() != pattern(k, size))


def replay(cc, trace: list[list[int]]) -> tuple[float, int, int]:
    """(hit rate, requests whose load found fewer blocks than their exists, wrong bytes)."""
    hits = asked = disagree = wrong = 0
    for chain in trace:
        keys = keys_of(chain)
        asked += len(keys)
        n = cc.exists(keys).success
        got = bad = 0
        if n:
            got, bad = load(cc, keys[:n])
        disagree += got < n
        wrong += bad
        hits += got
        if n < len(keys):
            assert save(cc, keys[n:]) == len(keys) - n
    return hits / asked, disagree, wrong


def _cc():
    from ems import CcConfig, EmsConfig
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="trace")))
    return Ems.get_cc()


def test_the_daemon_is_at_least_lru_on_a_prefix_caching_trace(make_server, client_env):
    server = make_server(capacity="2M")
    client_env(server)
    cc = _cc()
    try:
        trace = synthetic_trace(2500, seed=7)
        capacity_blocks = anonymous_stats(server)["capacity_bytes"] // BLOCK
        lru = lru_hit_rate(trace, capacity_blocks)
        hit_rate, disagree, wrong = replay(cc, trace)
        stats = cc.statistics()
    finally:
        Ems.finalize()
    assert wrong == 0 and disagree == 0
    assert lru > 0.1
    assert hit_rate >= 0.99 * lru, (hit_rate, lru)
    # the pool ran full: (nearly) every byte holds a live block
    assert stats.live_bytes >= 0.98 * stats.capacity_bytes, stats
    assert stats.evictions_fragmentation == 0


def test_a_load_after_an_exists_finds_what_it_counted_with_the_disk_tier(
        make_server, client_env, tmp_path):
    # A pool of 6 blocks; the chain [a, b, c, d]: b only on disk, d the LRU victim.
    # Bringing b in used to evict d (the request's own later block): the exists
    # counted 4 (a here, b c d on disk) and the load then found 3.
    server = make_server(capacity="1M", extra_args=["--disk", str(tmp_path / "disk")])
    big = 160 << 10  # 6 of them fill the 1 MiB pool
    client_env(server)
    cc = _cc()
    try:
        a, b, c, d = (f"chain-{x}" for x in "abcd")

        def on_disk(n: int) -> None:  # write-behind done: nothing pinned by it
            wait_for(lambda: anonymous_stats(server)["tiers"]["disk"]["objects"] == n,
                     10.0, f"{n} objects on disk")
        assert save(cc, [b], big) == 1
        assert save(cc, [d, a, c], big) == 3
        on_disk(4)
        assert save(cc, ["f1", "f2", "f3"], big) == 3  # the pool is full: b is evicted
        on_disk(7)
        assert anonymous_stats(server)["objects"] == 6
        assert load(cc, [a], big) == (1, 0) and load(cc, [c], big) == (1, 0)
        assert load(cc, ["f1", "f2", "f3"], big) == (3, 0)  # d: the least recently used
        n = cc.exists([a, b, c, d]).success
        assert n == 4
        assert load(cc, [a, b, c, d], big) == (4, 0)
    finally:
        Ems.finalize()


def test_a_load_fills_every_disk_run_of_its_chain(make_server, client_env, tmp_path):
    # [a, b, c, e]: a and c here, b and e only on disk. The disk's fill brings the run
    # of misses up to the first key that is here (b); the load then asks the disk
    # again for the keys after c, as the exists counted them (before: 3 of 4).
    server = make_server(capacity="1M", extra_args=["--disk", str(tmp_path / "disk")])
    big = 160 << 10  # 6 of them fill the 1 MiB pool
    client_env(server)
    cc = _cc()
    try:
        a, b, c, e = (f"chain-{x}" for x in "abce")

        def on_disk(n: int) -> None:
            wait_for(lambda: anonymous_stats(server)["tiers"]["disk"]["objects"] == n,
                     10.0, f"{n} objects on disk")
        assert save(cc, [b, e], big) == 2
        on_disk(2)
        assert save(cc, [a, c], big) == 2
        on_disk(4)
        assert save(cc, ["f1", "f2", "f3", "f4"], big) == 4  # b and e are evicted
        on_disk(8)
        assert cc.exists([b]).success == 1 and anonymous_stats(server)["objects"] == 6
        assert cc.exists([a, b, c, e]).success == 4
        assert load(cc, [a, b, c, e], big) == (4, 0)
    finally:
        Ems.finalize()


def test_exists_then_load_agree_over_a_trace_with_the_disk_tier(
        make_server, client_env, tmp_path):
    server = make_server(capacity="1M", extra_args=["--disk", str(tmp_path / "disk")])
    client_env(server)
    cc = _cc()
    try:
        _, disagree, wrong = replay(cc, synthetic_trace(1500, seed=3))
        stats = anonymous_stats(server)
    finally:
        Ems.finalize()
    assert wrong == 0
    assert disagree == 0
    assert stats["tiers"]["disk"]["hits"] > 0  # the disk tier served part of it
