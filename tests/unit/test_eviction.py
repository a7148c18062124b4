"""Eviction through the SDK: a small embedded pool (EMS_CAPACITY) evicts the least
recently used values; recently loaded (or re-saved) keys survive; pinned values are
never evicted under a reader."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ems import CcConfig, CcKvOption, CcResult, KvBufferWrapper
from ems.client import copy as ems_copy

VALUE = 64 << 10  # 16 values fill the 1 MiB pool exactly


def buf(arr) -> KvBufferWrapper:
    return KvBufferWrapper(arr.ctypes.data, arr.nbytes)


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, VALUE, dtype=np.uint8)


@pytest.fixture
def small(monkeypatch, make_cc):
    monkeypatch.setenv("EMS_CAPACITY", "1M")
    return make_cc(cc_config=CcConfig(0, 0, "m"))


def save(cc, *ids):
    values = [value(i) for i in ids]  # alive until the copy is done
    r = cc.save(CcKvOption(), [f"k{i}" for i in ids], [[buf(v)] for v in values])
    assert r == CcResult(len(ids), len(ids))


def hit(cc, i) -> bool:
    out = np.zeros(VALUE, np.uint8)
    ok = cc.load(CcKvOption(), [f"k{i}"], [[buf(out)]]).success == 1
    if ok:
        assert np.array_equal(out, value(i)), f"k{i} came back with other bytes"
    else:
        assert not out.any()
    return ok


def test_lru_eviction_keeps_recently_loaded_keys(small, idle):
    cc = small
    save(cc, *range(12))
    assert hit(cc, 0)  # k0 is now the most recently used
    save(cc, *range(12, 20))  # 20 values > 16 slots: 4 evictions
    stats = cc.statistics()
    assert stats.capacity_bytes == 1 << 20
    assert stats.evictions >= 4
    assert stats.used_bytes <= stats.capacity_bytes
    assert hit(cc, 0)
    assert not any(hit(cc, i) for i in (1, 2, 3, 4))
    assert all(hit(cc, i) for i in range(5, 20))
    idle(cc)


def test_resaving_an_existing_key_refreshes_it(small):
    cc = small
    save(cc, *range(16))
    save(cc, 0)  # write-once: nothing copied, but the key was used
    save(cc, 16)
    assert hit(cc, 0) and not hit(cc, 1)


def test_used_bytes_never_exceed_capacity_under_churn(small, idle):
    cc = small
    rng = np.random.default_rng(0)
    for _ in range(6):
        ids = [int(i) for i in rng.choice(64, size=8, replace=False)]
        values = [value(i) for i in ids]
        cc.save(CcKvOption(), [f"k{i}" for i in ids], [[buf(v)] for v in values])
        stats = cc.statistics()
        assert stats.used_bytes <= stats.capacity_bytes
        assert stats.objects <= 16
    for i in range(64):
        hit(cc, i)  # whatever hits has the right bytes
    idle(cc)


def test_a_value_larger_than_the_pool_is_a_failed_key_not_an_error(small):
    cc = small
    save(cc, 1)
    huge = np.zeros(2 << 20, np.uint8)
    v2 = value(2)
    r = cc.save(CcKvOption(), ["huge", "k2"], [[buf(huge)], [buf(v2)]])
    assert r == CcResult(0, 2)
    assert hit(cc, 1)  # nothing was evicted for a value that can never fit
    assert cc.statistics().evictions == 0


def test_a_value_being_loaded_is_not_evicted(small, monkeypatch, idle):
    """A slow reader pins k0; saves that overflow the pool evict around it."""
    cc = small
    save(cc, *range(16))
    out = np.zeros(VALUE, np.uint8)
    lo, hi = out.ctypes.data, out.ctypes.data + out.nbytes
    real = ems_copy.copy_bytes
    started = threading.Event()

    def slow_into_out(dst, src, n):
        if lo <= dst < hi:  # only the reader's copy is slow
            started.set()
            time.sleep(0.3)
        real(dst, src, n)

    monkeypatch.setattr(ems_copy, "copy_bytes", slow_into_out)
    reader = cc.async_load(CcKvOption(timeout=0), ["k0"], [[buf(out)]])
    assert started.wait(5)
    assert cc.statistics().pinned == 1
    save(cc, *range(100, 115))  # evicts every value but the pinned one
    assert cc.statistics().evictions == 15
    assert reader.result() == CcResult(1, 1)
    assert np.array_equal(out, value(0))
    idle(cc)


def test_a_pool_full_of_pinned_values_refuses_new_ones(small, monkeypatch, idle):
    cc = small
    save(cc, *range(16))
    outs = [np.zeros(VALUE, np.uint8) for _ in range(16)]
    real = ems_copy.copy_bytes
    gate = threading.Event()

    def held(dst, src, n):
        if any(o.ctypes.data == dst for o in outs):
            gate.wait(10)
        real(dst, src, n)

    monkeypatch.setattr(ems_copy, "copy_bytes", held)
    reader = cc.async_load(CcKvOption(timeout=0), [f"k{i}" for i in range(16)],
                           [[buf(o)] for o in outs])
    deadline = time.monotonic() + 5
    while cc.statistics().pinned < 16:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    v99 = value(99)
    r = cc.save(CcKvOption(), ["k99"], [[buf(v99)]])
    assert r == CcResult(0, 1)  # no room: a failed key, not an exception
    gate.set()
    assert reader.result() == CcResult(16, 16)
    assert all(np.array_equal(o, value(i)) for i, o in enumerate(outs))
    idle(cc)
    save(cc, 99)  # the pins are gone: now it fits
