"""The bench's Mooncake-over-TCP peer (``mooncake-tcp``): bytes right, processes stopped.

Runs the real Mooncake Store (``mooncake_master`` + two worker processes with protocol
"tcp" on 127.0.0.1) where ``benchmarks/setup-peers.sh`` installed it; skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="Mooncake Store is not installed (bash benchmarks/setup-peers.sh)")


def _pids(system) -> list[int]:
    store = [system._store.pid] if system._store is not None else []
    return [system._master.pid, system.a.service.pid, system.b.service.pid, *store]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie of ours would still answer: reaped by Service.stop's wait
    return False


def _system(tmp_path, layout: str = "host-a"):
    from ems.bench.mooncake_tcp import MooncakeTcpSystem
    from ems.bench.systems import Unavailable
    try:
        return MooncakeTcpSystem(str(tmp_path), 64 << 20, layout=layout)
    except Unavailable as exc:
        pytest.skip(f"mooncake-tcp cannot run here: {exc}")


@pytest.mark.parametrize("layout", ["host-a", "store-node"])
def test_host_b_loads_what_host_a_saved_bit_exact_and_every_process_stops(tmp_path, layout):
    system = _system(tmp_path, layout)
    pids = _pids(system)
    assert len(pids) == (4 if layout == "store-node" else 3)
    try:
        n, size = 8, 256 << 10
        src = system.alloc(n * size).reshape(n, size)
        dst = system.alloc(n * size).reshape(n, size)
        src[:] = np.random.default_rng(7).integers(0, 256, src.shape, dtype=np.uint8)
        keys = [f"k{i}" for i in range(n)]
        system.save(keys, src)
        system.load(keys, dst)
        assert np.array_equal(src, dst)
        system.reset()  # removed from A's segment: B misses now
        from ems.bench.systems import BenchError
        with pytest.raises(BenchError, match="batch_get_into on host B"):
            system.load(keys, dst)
    finally:
        system.close()
    assert all(_gone(p) for p in pids), pids


def test_a_dead_worker_is_a_clean_error_and_close_stops_the_rest(tmp_path):
    from ems.bench.systems import BenchError
    system = _system(tmp_path)
    pids = _pids(system)
    try:
        src = system.alloc(4 << 20).reshape(4, -1)
        os.kill(system.a.service.pid, signal.SIGKILL)
        system.a.service.proc.wait(10)
        with pytest.raises(BenchError, match="host a"):
            system.save(["x0", "x1", "x2", "x3"], src)
    finally:
        system.close()
    assert all(_gone(p) for p in pids), pids
