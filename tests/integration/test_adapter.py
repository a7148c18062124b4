"""The SDK driven as the real EMS adapter drives it (../shared/spec/API.md), against a
real daemon that starts *after* the inference process.

The adapter's recovery logic, restated in :class:`Adapter`: ``Ems.init``; on
``EMS_RECOVERD_ERROR`` remember to re-init; a health thread polls
``Ems.check_health()`` (every ~10 s; here the test calls the tick) and, when it is True
while not initialised, calls ``Ems.init`` again and then ``register_kvcache`` with the
caches it kept. Any other init error leaves it degraded for good.
"""

from __future__ import annotations

import time

import pytest
from support.itest_support import KEY_A

from ems import (
    CcConfig_v1,
    CcKvOption,
    CcResult,
    Ems,
    EmsConfig,
    EmsErrorCode,
    EmsException,
    KVCacheType,
)

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.torch]

#: the adapter's shipped defaults
MODEL_ID = "cc_kvstore@_@ds_default_ns_001"
ACCESS_ID = "ems@_@default"
ACCESS_KEY = ""
NB, BS = 16, 16


class Adapter:
    """The real client's init / health / re-init state machine."""

    def __init__(self, config: EmsConfig, caches, block_size=None) -> None:
        self.config = config
        self.caches = caches
        self.block_size = block_size
        self.cc = None
        self.retry_init = False
        self.degraded_for_good = False

    def init(self) -> None:
        try:
            Ems.init(self.config)
        except EmsException as exc:
            if exc.status_code() is EmsErrorCode.EMS_RECOVERD_ERROR:
                self.retry_init = True
            else:
                self.degraded_for_good = True
            self.last_error = exc
            return
        self.cc = Ems.get_cc()
        self.cc.register_kvcache(self.caches, block_size=self.block_size)

    def health_tick(self) -> bool:
        healthy = Ems.check_health()
        if healthy and self.cc is None and self.retry_init:
            self.retry_init = False
            self.init()
        return healthy


def randomize(caches, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in caches:
        for t in layer:
            raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                                generator=g)
            t.copy_(raw.view(t.dtype).view(t.shape))


def bits(t):
    return t.contiguous().view(torch.uint8)


def mla():  # [nope bf16, pe fp16] per layer, paged
    return [[torch.empty(NB, BS, 1, 32, dtype=torch.bfloat16),
             torch.empty(NB, BS, 1, 8, dtype=torch.float16)] for _ in range(3)]


def three_d():  # [num_blocks, block_size, heads*head_size]
    return [[torch.empty(NB, BS, 64, dtype=torch.float16) for _ in "kv"] for _ in range(3)]


def nz():  # [num_blocks, heads*head_size/16, block_size, 16]: opaque pages
    return [[torch.empty(NB, 4, BS, 16, dtype=torch.float16) for _ in "kv"]
            for _ in range(3)]


def v1_config() -> EmsConfig:
    cfg = CcConfig_v1(rank_id=0, device_id=0, model_id=MODEL_ID, tp_world_size=2,
                      rank_in_tp_group=1, llm_engine="vllm@my-service")
    cfg.kvcache_type = KVCacheType.MLA  # the adapter sets the attribute after construction
    return EmsConfig(access_id=ACCESS_ID, access_key=ACCESS_KEY, cc_config_v1=cfg)


def slots(blocks):
    return [b * BS + p for b in blocks for p in range(BS)]


def round_trip(cc, caches, first_hash: int) -> None:
    """async_save of blocks 0-2, is_ready polling, get_result; async_load into 8-10."""
    hashes = [first_hash + i for i in range(3)]
    opt = CcKvOption(timeout=5000)
    fut = cc.async_save(slots([0, 1, 2]), hashes, [BS] * 3, opt)
    deadline = time.monotonic() + 10
    while not cc.is_ready(fut):
        assert time.monotonic() < deadline, "async_save not ready in 10 s"
        time.sleep(0.001)
    assert cc.get_result(fut) == CcResult(3, 3)
    assert cc.exists(hashes + [first_hash + 99], opt) == CcResult(3, 4)
    for layer in caches:
        for t in layer:
            t[8:11].zero_()
    fut = cc.async_load(slots([8, 9, 10]), hashes, [BS] * 3, opt)
    assert cc.get_result(fut) == CcResult(3, 3)
    for layer in caches:
        for t in layer:
            assert torch.equal(bits(t[8:11]), bits(t[0:3]))


def test_adapter_starts_before_its_daemon_and_recovers(make_server, client_env,
                                                       monkeypatch):
    server = make_server(capacity="64M", start=False)
    client_env(server)
    monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "500")
    caches = mla()
    randomize(caches, 1)
    adapter = Adapter(v1_config(), caches)

    t0 = time.monotonic()
    adapter.init()  # no daemon yet: no socket at all
    assert time.monotonic() - t0 < 2.0
    assert adapter.retry_init and not adapter.degraded_for_good and adapter.cc is None
    assert "check_health" in adapter.last_error.message()
    t0 = time.monotonic()
    assert adapter.health_tick() is False  # bounded probe, never raises
    assert time.monotonic() - t0 < 2.0 and adapter.cc is None

    server.start()
    assert adapter.health_tick() is True  # -> Ems.init again + register_kvcache
    assert adapter.cc is not None and not adapter.retry_init
    round_trip(adapter.cc, caches, 0x100)

    # The other layouts real clients register, one after the other in this process.
    for make, block_size, first in ((three_d, None, 0x200), (nz, BS, 0x300)):
        caches = make()
        randomize(caches, first)
        adapter.cc.register_kvcache(caches, block_size=block_size)
        round_trip(adapter.cc, caches, first)

    # A restarted daemon keeps working for an initialised client, without re-init.
    server.restart()
    deadline = time.monotonic() + 10
    while not Ems.check_health():
        assert time.monotonic() < deadline, "no reconnect after the daemon restarted"
        time.sleep(0.05)
    round_trip(adapter.cc, caches, 0x400)
    Ems.finalize()


def test_a_stale_socket_is_retryable_and_a_refusal_is_not(make_server, client_env,
                                                          monkeypatch):
    server = make_server(capacity="32M", anonymous=False, tenants={"t@a/B:1": KEY_A})
    client_env(server)
    # Anonymous access refused: retrying cannot fix it.
    adapter = Adapter(v1_config(), mla())
    adapter.init()
    assert adapter.degraded_for_good and not adapter.retry_init
    assert adapter.last_error.status_code() is EmsErrorCode.EMS_AUTH_FAILED
    # A tenant whose access_id holds "@", "/", ":" and upper case connects.
    cfg = v1_config()
    cfg.access_id, cfg.access_key = "t@a/B:1", KEY_A
    Ems.init(cfg)
    Ems.get_cc().register_kvcache(mla())
    assert Ems.get_cc().statistics().capacity_bytes > 0
    Ems.finalize()
    # A daemon that died (its socket left behind, stale): retryable.
    server.kill()
    monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "300")
    with pytest.raises(EmsException) as info:
        Ems.init(cfg)
    assert info.value.status_code() is EmsErrorCode.EMS_RECOVERD_ERROR
    assert Ems.check_health() is False
    server.start()
    assert Ems.check_health() is True  # before init: the probe reaches the new daemon
    Ems.init(cfg)
    assert Ems.check_health() is True
    Ems.finalize()
