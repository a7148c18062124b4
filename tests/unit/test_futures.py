"""CcFuture / is_ready / get_result, many requests in flight, and one ContextCaching
shared by several threads (V0 and V1 mixed)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ems import (
    CcConfig,
    CcConfig_v1,
    CcFuture,
    CcKvOption,
    CcResult,
    EmsErrorCode,
    EmsException,
    KvBufferWrapper,
)


def buf(arr) -> KvBufferWrapper:
    return KvBufferWrapper(arr.ctypes.data, arr.nbytes)


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_future_result_is_ready_and_get_result(cc, option):
    value = data(64, 1)
    fut = cc.async_save(option, ["f"], [[buf(value)]])
    assert isinstance(fut, CcFuture)
    assert cc.get_result(fut) == CcResult(1, 1)
    assert cc.is_ready(fut) is True
    assert fut.result() == CcResult(1, 1)  # result() may be called again
    assert "done" in repr(fut)
    out = np.zeros(64, np.uint8)
    fut = cc.async_load(option, ["f"], [[buf(out)]])
    fut.result()
    assert cc.is_ready(fut) and cc.get_result(fut) == CcResult(1, 1)
    assert np.array_equal(out, value)


def test_is_ready_polls_until_done(cc, option):
    value = data(1 << 16, 2)
    fut = cc.async_save(option, ["poll"], [[buf(value)]])
    for _ in range(10000):
        if cc.is_ready(fut):
            break
        threading.Event().wait(0.001)
    assert cc.is_ready(fut)
    assert cc.get_result(fut).success == 1


@pytest.mark.parametrize("bad", [None, 5, CcResult(1, 1)])
def test_is_ready_and_get_result_reject_non_futures(cc, bad):
    for method in (cc.is_ready, cc.get_result):
        with pytest.raises(EmsException) as info:
            method(bad)
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "future" in info.value.message()


def test_many_requests_in_flight_then_collected(cc, option, idle):
    """The seeds' pattern: submit several async requests, then collect them."""
    values = {f"k{i}": data(256 + i, i) for i in range(40)}
    futures = [cc.async_save(option, [k], [[buf(v)]]) for k, v in values.items()]
    assert all(f.result() == CcResult(1, 1) for f in futures)
    outs = {k: np.zeros_like(v) for k, v in values.items()}
    futures = [cc.async_load(option, [k], [[buf(o)]]) for k, o in outs.items()]
    assert all(f.result() == CcResult(1, 1) for f in futures)
    assert all(np.array_equal(values[k], outs[k]) for k in values)
    idle(cc)


def test_concurrent_async_requests_from_several_threads(cc, idle):
    """4 threads x 20 async requests each, on one ContextCaching; every byte checked."""
    n_threads, n_requests = 4, 20
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def worker(t: int) -> None:
        try:
            opt = CcKvOption(timeout=10000)
            values = [[data(128, 1000 * t + 2 * r), data(64 + r, 1000 * t + 2 * r + 1)]
                      for r in range(n_requests)]
            keys = [[f"t{t}-r{r}-a", f"t{t}-r{r}-b"] for r in range(n_requests)]
            barrier.wait()
            saves = [cc.async_save(opt, k, [[buf(x)] for x in v]) for k, v in zip(keys, values)]
            assert [f.result() for f in saves] == [CcResult(2, 2)] * n_requests
            outs = [[np.zeros_like(x) for x in v] for v in values]
            loads = [cc.async_load(opt, k, [[buf(x)] for x in o]) for k, o in zip(keys, outs)]
            assert [cc.get_result(f) for f in loads] == [CcResult(2, 2)] * n_requests
            for v, o in zip(values, outs):
                assert all(np.array_equal(a, b) for a, b in zip(v, o))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors
    assert cc.statistics().objects == n_threads * n_requests * 2
    idle(cc)


def test_threads_racing_to_save_the_same_keys(cc, idle):
    """Write-once under contention: every save succeeds, one value wins for all."""
    n = 6
    values = [data(4096, 50 + t) for t in range(n)]
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def worker(t: int) -> None:
        barrier.wait()
        results[t] = [cc.save(CcKvOption(), [f"same{i}"], [[buf(values[t])]])
                      for i in range(10)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert all(r == [CcResult(1, 1)] * 10 for r in results)
    idle(cc)
    for i in range(10):
        out = np.zeros(4096, np.uint8)
        assert cc.load(CcKvOption(), [f"same{i}"], [[buf(out)]]).success == 1
        assert any(np.array_equal(out, v) for v in values)


def test_v0_and_v1_mixed_from_several_threads(make_cc, idle):
    torch = pytest.importorskip("torch")
    nb, bs = 32, 4
    caches = [[torch.randn(nb, bs, 2, 8), torch.randn(nb, bs, 2, 8)] for _ in range(2)]
    cc = make_cc(cc_config=CcConfig(0, 0, "m"), cc_config_v1=CcConfig_v1(0, 0, "m"))
    cc.register_kvcache(caches)
    snapshot = [[t.clone() for t in layer] for layer in caches]
    errors: list[BaseException] = []

    def v1_worker(t: int) -> None:
        # thread t saves blocks 4t..4t+1 and loads them into its own blocks 4t+2..4t+3
        try:
            src, dst = [4 * t, 4 * t + 1], [4 * t + 2, 4 * t + 3]
            slots = lambda ids: [b * bs + p for b in ids for p in range(bs)]  # noqa: E731
            hashes = [10_000 * (t + 1) + i for i in range(2)]
            for _ in range(5):
                assert cc.save(slots(src), hashes, [bs, bs]).success == 2
                f = cc.async_load(slots(dst), hashes, [bs, bs])
                assert f.result() == CcResult(2, 2)
                for layer in caches:
                    for x in layer:
                        assert torch.equal(x[dst[0]], x[src[0]])
                        assert torch.equal(x[dst[1]], x[src[1]])
                assert cc.exists(hashes).success == 2
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def v0_worker(t: int) -> None:
        try:
            opt = CcKvOption()
            for rep in range(10):
                v = data(512, 100 * t + rep)
                out = np.zeros_like(v)
                assert cc.save(opt, [f"v0-{t}-{rep}"], [[buf(v)]]).success == 1
                assert cc.async_load(opt, [f"v0-{t}-{rep}"], [[buf(out)]]).result().success == 1
                assert np.array_equal(v, out)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=v1_worker, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=v0_worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    # blocks that no thread touched are unchanged
    for layer, before in zip(caches, snapshot):
        for x, b in zip(layer, before):
            assert torch.equal(x[16:], b[16:])
    idle(cc)


def test_a_failed_request_reports_through_its_future(cc, option, monkeypatch):
    """A transport failure surfaces from result() as an EmsException (never hangs)."""
    def broken(*args, **kwargs):
        raise EmsException(EmsErrorCode.EMS_IO_ERROR, "pool lost")

    monkeypatch.setattr(cc._transport, "load", broken)
    out = np.zeros(8, np.uint8)
    fut = cc.async_load(option, ["k"], [[buf(out)]])
    with pytest.raises(EmsException) as info:
        fut.result()
    assert info.value.status_code() is EmsErrorCode.EMS_IO_ERROR
    assert cc.is_ready(fut)


def test_an_unexpected_error_becomes_internal_error(cc, option, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(cc._transport, "save", broken)
    with pytest.raises(EmsException) as info:
        cc.save(option, ["k"], [[KvBufferWrapper(4096, 8)]])  # never copied
    assert info.value.status_code() is EmsErrorCode.EMS_INTERNAL_ERROR
    assert "ZeroDivisionError" in info.value.message()
