"""Four processes saving and loading one key space at once, with eviction going on:
every loaded byte is checked against the key's pattern."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_four_processes_concurrently_zero_wrong_bytes(make_server, workers):
    # 48 keys of 32 KiB = 1.5 MiB of key space over a 1 MiB pool: constant eviction,
    # while other processes hold pins and reservations on the same keys.
    server = make_server(capacity="1M")
    procs = [workers.start(server, "mixed", seed=seed, rounds=12, key_space=48, size=32768,
                           batch=6) for seed in range(4)]
    results = [workers.result(p, timeout_s=90) for p in procs]
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["errors"] for r in results) == 0
    assert sum(r["saved"] for r in results) > 0
    assert sum(r["loaded"] for r in results) > 0
    stats = server.stats()["tenants"]["(anonymous)"]
    assert stats["evictions"] > 0
    assert stats["pinned"] == 0 and stats["reserved"] == 0
