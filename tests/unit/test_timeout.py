"""Deadlines (CcKvOption.timeout): a request that times out raises EMS_IO_TIMEOUT
and never writes into the caller's memory after raising; timeout=0 means no deadline;
a request still queued past its deadline times out without running.

The copy is made slow *in the test* by wrapping ``ems.client.copy.copy_bytes``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ems import CcConfig, CcKvOption, CcResult, EmsErrorCode, EmsException, KvBufferWrapper
from ems.client import copy as ems_copy

N_BUFFERS, BUF_BYTES = 20, 4096


def buf(arr) -> KvBufferWrapper:
    return KvBufferWrapper(arr.ctypes.data, arr.nbytes)


@pytest.fixture
def slow_copy(monkeypatch):
    """``slow_copy(seconds)``: every later copy_bytes sleeps first, then copies."""
    real = ems_copy.copy_bytes

    def install(delay_s: float) -> None:
        def slow(dst: int, src: int, n: int) -> None:
            time.sleep(delay_s)
            real(dst, src, n)
        monkeypatch.setattr(ems_copy, "copy_bytes", slow)
    return install


def stored_value(cc, key="big", seed=7):
    """Save one key whose value is N_BUFFERS buffers; return the source arrays."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(1, 256, BUF_BYTES, dtype=np.uint8) for _ in range(N_BUFFERS)]
    assert cc.save(CcKvOption(), [key], [[buf(p) for p in parts]]).success == 1
    return parts


def test_load_timeout_raises_and_writes_nothing_afterwards(cc, slow_copy, idle):
    parts = stored_value(cc)
    out = [np.zeros(BUF_BYTES, np.uint8) for _ in range(N_BUFFERS)]
    slow_copy(0.02)  # 20 buffers x 20 ms = 400 ms >> 50 ms
    start = time.monotonic()
    with pytest.raises(EmsException) as info:
        cc.load(CcKvOption(timeout=50), ["big"], [[buf(o) for o in out]])
    elapsed = time.monotonic() - start
    at_raise = [o.copy() for o in out]
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    assert "timeout=50" in info.value.message()
    assert elapsed < 0.4, elapsed  # stopped at the next checkpoint, not at the end
    idle(cc)  # the pin was given back: the copy has stopped (EmbeddedTransport.load)
    for now, then in zip(out, at_raise):
        assert np.array_equal(now, then)  # no late writes
    # what was written is a prefix of the value, never foreign bytes
    written = [i for i, o in enumerate(out) if o.any()]
    assert written == list(range(len(written))) and len(written) < N_BUFFERS
    assert all(np.array_equal(out[i], parts[i]) for i in written)


def test_async_load_timeout_through_the_future(cc, slow_copy, idle):
    stored_value(cc)
    out = [np.zeros(BUF_BYTES, np.uint8) for _ in range(N_BUFFERS)]
    slow_copy(0.02)
    fut = cc.async_load(CcKvOption(timeout=50), ["big"], [[buf(o) for o in out]])
    deadline = time.monotonic() + 2
    while not cc.is_ready(fut):  # ready once past its deadline, even mid-copy
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(EmsException) as info:
        cc.get_result(fut)
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    at_raise = [o.copy() for o in out]
    idle(cc)  # the copy has stopped
    assert all(np.array_equal(a, b) for a, b in zip(out, at_raise))
    with pytest.raises(EmsException):  # the outcome is stable
        fut.result()


def test_save_timeout_stores_nothing(cc, slow_copy, idle):
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 256, BUF_BYTES, dtype=np.uint8) for _ in range(N_BUFFERS)]
    slow_copy(0.02)
    with pytest.raises(EmsException) as info:
        cc.save(CcKvOption(timeout=50), ["late", "later"],
                [[buf(p) for p in parts[:10]], [buf(p) for p in parts[10:]]])
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    idle(cc)  # the reservations were given back
    stats = cc.statistics()
    assert stats.objects == 0 and stats.used_bytes == 0
    out = [np.zeros(BUF_BYTES, np.uint8) for _ in range(10)]
    assert cc.load(CcKvOption(), ["late"], [[buf(o) for o in out]]).success == 0


def test_timeout_zero_means_no_deadline(cc, slow_copy):
    parts = stored_value(cc)
    out = [np.zeros(BUF_BYTES, np.uint8) for _ in range(N_BUFFERS)]
    slow_copy(0.01)  # about 200 ms in all
    result = cc.load(CcKvOption(timeout=0), ["big"], [[buf(o) for o in out]])
    assert result == CcResult(1, 1)
    assert all(np.array_equal(a, b) for a, b in zip(out, parts))
    fut = cc.async_save(CcKvOption(timeout=0), ["big2"], [[buf(p) for p in parts]])
    assert fut.result() == CcResult(1, 1)


def test_a_generous_timeout_is_not_hit(cc, slow_copy):
    parts = stored_value(cc)
    out = [np.zeros(BUF_BYTES, np.uint8) for _ in range(N_BUFFERS)]
    slow_copy(0.002)
    assert cc.load(CcKvOption(timeout=20000), ["big"], [[buf(o) for o in out]]).success == 1
    assert all(np.array_equal(a, b) for a, b in zip(out, parts))


@pytest.fixture
def one_worker(monkeypatch, make_cc):
    monkeypatch.setenv("EMS_WORKERS", "1")
    return make_cc(cc_config=CcConfig(0, 0, "m"))


def test_queued_request_times_out_while_waiting(one_worker, slow_copy, idle):
    cc = one_worker
    parts = stored_value(cc)
    small = np.arange(64, dtype=np.uint8)
    assert cc.save(CcKvOption(), ["small"], [[buf(small)]]).success == 1
    slow_copy(0.015)
    busy_out = [np.zeros(BUF_BYTES, np.uint8) for _ in range(N_BUFFERS)]
    busy = cc.async_load(CcKvOption(timeout=0), ["big"], [[buf(o) for o in busy_out]])
    queued_out = np.zeros(64, np.uint8)
    queued = cc.async_load(CcKvOption(timeout=50), ["small"], [[buf(queued_out)]])
    with pytest.raises(EmsException) as info:
        queued.result()  # the only worker is busy for ~300 ms
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    assert not cc.is_ready(busy)  # raised while the only worker was still busy
    assert busy.result() == CcResult(1, 1)
    assert all(np.array_equal(a, b) for a, b in zip(busy_out, parts))
    time.sleep(0.1)  # the worker has dropped the queued request by now
    assert not queued_out.any()  # it never ran
    idle(cc)


def test_queued_request_past_its_deadline_is_not_run(one_worker, slow_copy, idle):
    """Nobody waits on it: the worker sees the deadline passed and skips it."""
    cc = one_worker
    stored_value(cc)
    small = np.arange(1, 65, dtype=np.uint8)
    assert cc.save(CcKvOption(), ["small"], [[buf(small)]]).success == 1
    slow_copy(0.01)
    busy_out = [np.zeros(BUF_BYTES, np.uint8) for _ in range(N_BUFFERS)]
    busy = cc.async_load(CcKvOption(timeout=0), ["big"], [[buf(o) for o in busy_out]])
    queued_out = np.zeros(64, np.uint8)
    queued = cc.async_load(CcKvOption(timeout=30), ["small"], [[buf(queued_out)]])
    assert busy.result().success == 1
    deadline = time.monotonic() + 2
    while not cc.is_ready(queued):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(EmsException) as info:
        queued.result()
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    assert not queued_out.any()
    assert cc.statistics().hits == 1  # only the busy load looked the pool up
    idle(cc)


def test_v1_timeout_writes_nothing_into_the_cache_afterwards(make_cc, monkeypatch, idle):
    torch = pytest.importorskip("torch")
    from ems import CcConfig_v1
    from ems.futures import Task

    nb, bs = 8, 4
    caches = [[torch.randn(nb, bs, 2, 8), torch.randn(nb, bs, 2, 8)] for _ in range(8)]
    cc = make_cc(cc_config_v1=CcConfig_v1(0, 0, "m"))
    cc.register_kvcache(caches)
    assert cc.save(list(range(2 * bs)), [1, 2], [bs, bs]).success == 2
    for layer in caches:
        for t in layer:
            t.zero_()
    # The V1 mover copies in steps with a checkpoint before each: one registered
    # tensor per step on the torch path, up to ``layout._CHUNK`` bytes of runs per
    # native call (here 256 B: one run, 32 steps). Slow every step down (>= 16 steps x
    # 20 ms >> 50 ms), whatever copy path the step takes.
    from ems.client import layout
    monkeypatch.setattr(layout, "_CHUNK", 256)
    real = Task.checkpoint

    def slow(self):
        time.sleep(0.02)
        real(self)

    monkeypatch.setattr(Task, "checkpoint", slow)
    with pytest.raises(EmsException) as info:
        cc.load(list(range(4 * bs, 6 * bs)), [1, 2], [bs, bs], CcKvOption(timeout=50))
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    at_raise = [t.clone() for layer in caches for t in layer]
    idle(cc)  # the pins were given back: the mover has stopped
    now = [t for layer in caches for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(now, at_raise))
    assert not now[-1].any()  # the last tensor's step never ran
