"""``EmsStorage`` against SGLang's own classes, without an engine (run in the SGLang
venv by test_backend.py; exits non-zero with the failed check's message).

    python backend_check.py SOCKET_DIR_OF_A_RUNNING_DAEMON DEAD_SOCKET_DIR DAEMON_PID

SGLang's ``HiCacheStorageConfig``, ``PoolTransfer``, ``PoolHitPolicy`` and
``StorageMetrics`` are the real ones; the host pool is a small stand-in with SGLang's
``page_first`` MHA layout and ``get_page_buffer_meta`` (building SGLang's own host pool
needs a device pool and a running scheduler: the end-to-end test does that).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolTransfer,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

PAGE = 4


class HostPool:
    """An MHA host pool, ``page_first``: K and V of ``[tokens, layers, heads, dim]``."""

    layout = "page_first"
    page_size = PAGE
    dtype = torch.float32

    def __init__(self, tokens: int = 128, layers: int = 2, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.rand(2, tokens, layers, 2, 8, generator=g)
        self.row = layers * 2 * 8 * 4

    def get_page_buffer_meta(self, indices):
        base = self.kv_buffer.data_ptr()
        v_off = self.kv_buffer[1].data_ptr() - base
        ptrs = []
        for i in range(0, len(indices), self.page_size):
            k = base + int(indices[i]) * self.row
            ptrs += [k, k + v_off]
        return ptrs, [self.row * self.page_size] * len(ptrs)

    def page(self, p: int) -> torch.Tensor:
        return self.kv_buffer[:, p * PAGE:(p + 1) * PAGE].clone()


def config(extra: dict, **kw) -> HiCacheStorageConfig:
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
                model_name="check-model",
                extra_config=dict({"backend_name": "ems", "module_path":
                                   "ems.integrations.sglang", "class_name": "EmsStorage",
                                   "interface_v1": 1}, **extra))
    base.update(kw)
    return HiCacheStorageConfig(**base)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


def pages(*ps: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in ps])


def main() -> None:
    from ems import Ems
    from ems.errors import EmsException
    from ems.integrations.session import PoolSession
    from ems.integrations.sglang import EmsStorage

    live, dead, daemon_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hashes = [f"{i:064x}" for i in range(1, 9)]

    # ---- the v1 path: pages out of one host pool, into a fresh one
    s = EmsStorage(config({"socket_dir": live, "pool": "server"}), {})
    src, dst = HostPool(seed=1), HostPool(seed=2)
    s.register_mem_pool_host(src)
    check(s.batch_exists(hashes) == 0, "nothing stored yet")
    ok = s.batch_set_v1(hashes[:4], pages(3, 5, 6, 7))
    check(ok == [True] * 4, f"batch_set_v1 stores every page ({ok})")
    check(s.batch_exists(hashes) == 4, "batch_exists: the leading pages present")
    s.register_mem_pool_host(dst)
    got = s.batch_get_v1(hashes[:6], pages(0, 1, 2, 8, 9, 10))
    check(got == [True] * 4 + [False] * 2, f"batch_get_v1: a prefix of True ({got})")
    check(all(type(x) is bool for x in got), "every result is a bool, never None")
    same = all(torch.equal(dst.page(d), src.page(p)) for d, p in [(0, 3), (1, 5), (2, 6),
                                                                  (8, 7)])
    check(same, "the loaded pages are the saved pages' K and V bytes")
    other = HostPool(seed=2)
    other.layout = "page_first_direct"  # the same page size, another byte order
    s.register_mem_pool_host(other)
    check(s.batch_exists(hashes) == 0, "another host layout does not find these pages")
    s.register_mem_pool_host(dst)
    check(s.get("nope", torch.zeros(4)) is None and not s.exists(hashes[5]),
          "the older single-key forms answer misses")
    t = torch.rand(PAGE * 8)
    check(s.set(hashes[5], t) and s.exists(hashes[0]), "set stores a flat page")
    back = torch.zeros_like(t)
    check(s.get(hashes[5], back) is back and torch.equal(back, t), "get loads it back")
    stats = s.statistics()
    check(stats.pages_saved == 4 and stats.pages_loaded == 4 and stats.pages_load_failed == 2,
          f"counters {stats}")
    check(stats.openmp_threads_joined == 1,
          f"the OpenMP warm-up ran once, on the one thread that called ({stats})")
    worker = threading.Thread(target=s.batch_exists, args=(hashes,))
    worker.start()
    worker.join()
    check(s.statistics().openmp_threads_joined == 2, "and once on another thread")
    m = s.get_stats()
    check(isinstance(m, StorageMetrics) and m.prefetch_pgs == [4] and m.backup_pgs == [4],
          f"get_stats: SGLang's StorageMetrics of the interval ({m})")
    check(s.get_stats().prefetch_pgs == [], "get_stats: the next interval starts empty")

    # ---- hybrid pools: a sidecar with the trailing-pages policy (SWA / Mamba state)
    sidecar = HostPool(seed=3)
    s.register_mem_pool_host(src)
    s.register_mem_host_pool_v2(src, "kv")
    s.register_mem_host_pool_v2(sidecar, "swa")
    res = s.batch_set_v2([PoolTransfer(name="swa", host_indices=pages(1, 2),
                                       keys=hashes[1:3])])
    check(res == {"swa": [True, True]}, f"batch_set_v2 of the sidecar ({res})")
    swa = [PoolTransfer(name="swa", keys=hashes[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    r = s.batch_exists_v2(hashes[:4], swa)
    check(r.kv_hit_pages == 3 and r.restorable_prefix_pages == [3],
          f"trailing window of 2: only the prefix of 3 pages is restorable ({r})")
    full = [PoolTransfer(name="swa", keys=hashes[:4], hit_policy=PoolHitPolicy.ALL_PAGES)]
    r = s.batch_exists_v2(hashes[:4], full)
    check(r.kv_hit_pages == 0, f"all-pages policy: page 0 of the sidecar missing ({r})")
    got = s.batch_get_v2([PoolTransfer(name="swa", host_indices=pages(20, 21, 22),
                                       keys=hashes[1:4])])
    check(got == {"swa": [True, True, False]}, f"batch_get_v2 ({got})")
    check(torch.equal(sidecar.page(20), sidecar.page(1))
          and torch.equal(sidecar.page(21), sidecar.page(2)), "the sidecar's pages loaded")
    s.close()

    # ---- MLA: TP rank 1 shares rank 0's keys and does not write
    mla = [EmsStorage(config({"socket_dir": live, "pool": "server"}, is_mla_model=True,
                             tp_rank=r, tp_size=2), {}) for r in (0, 1)]
    for m_ in mla:
        m_.register_mem_pool_host(src)
    check(mla[1].batch_set_v1(hashes[6:8], pages(0, 1)) == [True, True]
          and mla[1].batch_exists(hashes[6:8]) == 0, "MLA: a non-writer rank writes nothing")
    check(mla[0].batch_set_v1(hashes[6:8], pages(0, 1)) == [True, True]
          and mla[1].batch_exists(hashes[6:8]) == 2, "MLA: rank 1 finds rank 0's pages")
    for m_ in mla:
        m_.close()

    # ---- the pool hangs (SIGSTOP): every call within its deadline, then picked up again
    slow = EmsStorage(config({"socket_dir": live, "pool": "server", "timeout_ms": 500,
                              "lookup_timeout_ms": 200, "health_interval_s": 0.2}), {})
    slow.register_mem_pool_host(src)
    check(slow.batch_exists(hashes) == 4, "before the hang: the pages are there")
    os.kill(daemon_pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        # the load first: it meets the hung daemon (the others then answer at once:
        # the session is DOWN until the daemon answers a probe)
        hung = (slow.batch_get_v1(hashes[:2], pages(0, 1)),
                slow.batch_set_v1(hashes[6:8], pages(0, 1)), slow.batch_exists(hashes))
        took = time.monotonic() - t0
    finally:
        os.kill(daemon_pid, signal.SIGCONT)
    check(hung == ([False, False], [False, False], 0) and took < 3.0,
          f"a hung pool: misses within the deadlines ({hung}, {took:.2f} s)")
    deadline = time.monotonic() + 10
    while slow.batch_exists(hashes) != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    check(slow.batch_exists(hashes) == 4, "the pool answers again: picked up")
    slow.close()

    # ---- refused config, and the pool down at start
    try:
        EmsStorage(config({"socket_dir": live, "colour": "red"}), {})
        check(False, "an unknown key is refused")
    except EmsException as exc:
        check("colour" in str(exc), f"an unknown key is refused, named ({exc})")
    Ems.finalize()
    os.environ["EMS_CONNECT_TIMEOUT_MS"] = "300"
    t0 = time.monotonic()
    down = EmsStorage(config({"socket_dir": dead, "pool": "server",
                              "health_interval_s": 3600}), {})
    check(time.monotonic() - t0 < 5, "the constructor returns with the pool down")
    down.register_mem_pool_host(src)
    t0 = time.monotonic()
    answers = (down.batch_exists(hashes), down.batch_set_v1(hashes[:2], pages(0, 1)),
               down.batch_get_v1(hashes[:2], pages(0, 1)))
    check(answers == (0, [False, False], [False, False]) and time.monotonic() - t0 < 1,
          f"pool down: misses at once ({answers})")
    check(PoolSession._instance is not None and
          PoolSession._instance.state.value == "down", "the session is DOWN, probing")
    down.close()
    print("ALL OK")


if __name__ == "__main__":
    main()
