"""What real clients send (issue: the EMS adapter's defaults, V1 on a V0 config, opaque
page layouts, meta layouts for a scheduler process), on the embedded pool.

The daemon side of the same contract (init before the daemon exists, health polling,
re-init) is in ``tests/integration/test_adapter.py``.
"""

from __future__ import annotations

import pytest

from ems import CcConfig, CcConfig_v1, CcKvOption, CcResult, EmsErrorCode, EmsException

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

NB = 12


def randomize(t, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                        generator=g)
    t.copy_(raw.view(t.dtype).view(t.shape))


def bits(t):
    return t.contiguous().view(torch.uint8)


def slots_of(blocks, bs):
    return [b * bs + p for b in blocks for p in range(bs)]


@pytest.fixture(params=["native", "torch"])
def copy_path(request, monkeypatch):
    from ems.client import native

    if request.param == "native" and not native.available():
        pytest.skip("the native extension is not built here")
    if request.param == "torch":
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


def _pair(cfg_a, cfg_b):
    """Two ContextCaching objects on one embedded pool (Ems is per process)."""
    from ems.client.context_caching import ContextCaching
    from ems.client.embedded import EmbeddedTransport

    transport = EmbeddedTransport(16 << 20)
    a = ContextCaching(transport, None, cfg_a)
    b = ContextCaching(transport, None, cfg_b)

    def close():
        a.close()
        b.close()
        transport.close()
    return a, b, close


# ----------------------------------------------------------------- V1 on a V0 config

def test_official_register_kvcache_sample_with_a_v0_config(make_cc, copy_path):
    """The official sample: a V0 EmsConfig, then register_kvcache and V1 save/load."""
    cc = make_cc(cc_config=CcConfig(rank_id=8, device_id=0, model_id="llama2-13b"))
    caches = [[torch.empty(NB, 4, 2, 16, dtype=torch.float16) for _ in "kv"]
              for _ in range(2)]
    for i, layer in enumerate(caches):
        for j, t in enumerate(layer):
            randomize(t, 10 * i + j)
    cc.register_kvcache(caches)
    opt = CcKvOption(timeout=5000)
    assert cc.save(slot_mapping=slots_of([0, 1], 4), hashes=[11, 12], offsets=[4, 4],
                   option=opt) == CcResult(2, 2)
    assert cc.exists([11, 12, 13]) == CcResult(2, 3)
    f = cc.async_load(slot_mapping=slots_of([5, 6], 4), hashes=[11, 12], offsets=[4, 4],
                      option=opt)
    assert cc.get_result(f) == CcResult(2, 2)
    for layer in caches:
        for t in layer:
            assert torch.equal(bits(t[5:7]), bits(t[0:2]))


def test_v0_config_defaults_are_documented_and_keys_as_unique():
    from ems.config import KVCacheType, v1_from_v0

    one = v1_from_v0(CcConfig(rank_id=8, device_id=0, model_id="m"))
    assert (one.rank_in_tp_group, one.rank_in_pp_group, one.llm_engine,
            one.kvcache_type) == (0, 0, "vllm", KVCacheType.MHA)
    # With TP, ranks keep their own keys: positions come from rank_id, tp fastest.
    ranks = [v1_from_v0(CcConfig(rank_id=r, device_id=r, model_id="m", tp_world_size=2,
                                 pp_world_size=2)) for r in range(4)]
    assert [(c.rank_in_tp_group, c.rank_in_pp_group) for c in ranks] == [
        (0, 0), (1, 0), (0, 1), (1, 1)]


def test_tp_ranks_of_a_v0_config_do_not_share_blocks():
    from ems.client.context_caching import ContextCaching
    from ems.client.embedded import EmbeddedTransport

    transport = EmbeddedTransport(8 << 20)
    a = ContextCaching(transport, CcConfig(0, 0, "m", tp_world_size=2), None)
    b = ContextCaching(transport, CcConfig(1, 1, "m", tp_world_size=2), None)
    try:
        ca = [[torch.ones(4, 4, 1, 8)]]
        cb = [[torch.zeros(4, 4, 1, 8)]]
        a.register_kvcache(ca)
        b.register_kvcache(cb)
        assert a.save(slots_of([0], 4), [7], [4]).success == 1
        assert b.exists([7]).success == 0  # another TP rank's heads: not ours
        assert b.load(slots_of([1], 4), [7], [4]).success == 0
        assert int(bits(cb[0][0]).sum()) == 0
    finally:
        a.close()
        b.close()
        transport.close()


# ----------------------------------------------------------------- opaque pages

def vllm_cpu(nl=2, heads=2, bs=4, hs=8, dtype=torch.float32):
    """vLLM's CPU layout: one [num_blocks, kv_heads, 2*block_size, head_size] per layer."""
    return [[torch.empty(NB, heads, 2 * bs, hs, dtype=dtype)] for _ in range(nl)]


def nz(nl=2, heads=2, hs=16, bs=4, dtype=torch.float16):
    """The NZ layout: [num_blocks, heads*head_size/16, block_size, 16], K and V."""
    return [[torch.empty(NB, heads * hs // 16, bs, 16, dtype=dtype) for _ in "kv"]
            for _ in range(nl)]


OPAQUE = {"vllm-cpu": (vllm_cpu, 4), "nz": (nz, 4),
          # kv_heads == block_size: the shape alone would look paged
          "vllm-cpu-heads-eq-bs": (lambda: vllm_cpu(heads=4, bs=4), 4),
          "nz-bf16-mixed": (lambda: [[torch.empty(NB, 2, 4, 16, dtype=torch.bfloat16),
                                      torch.empty(NB, 1, 4, 16, dtype=torch.float16)]
                                     for _ in range(3)], 4)}


@pytest.mark.parametrize("name", list(OPAQUE))
def test_opaque_pages_round_trip_into_other_blocks(v1_cc, copy_path, idle, name):
    make, bs = OPAQUE[name]
    caches = make()
    for i, layer in enumerate(caches):
        for j, t in enumerate(layer):
            randomize(t, 100 * i + j)
    cc = v1_cc()
    cc.register_kvcache(caches, block_size=bs)
    want = [t[[1, 2, 3]].clone() for layer in caches for t in layer]
    assert cc.save(slots_of([1, 2, 3], bs), [31, 32, 33], [bs] * 3).success == 3
    for layer in caches:
        for t in layer:
            t[7:10].zero_()
    res = cc.load(slots_of([9, 7, 8], bs), [31, 32, 33], [bs] * 3)
    assert res == CcResult(3, 3)
    got = [t[[9, 7, 8]] for layer in caches for t in layer]
    assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
    # chunk_descs: one whole block per chunk works too
    assert cc.load(hashes=[32], chunk_descs=[[(4 * bs, bs)]]).success == 1
    assert all(torch.equal(bits(t[4]), bits(w[1]))
               for t, w in zip([t for layer in caches for t in layer], want))
    idle(cc)


@pytest.mark.parametrize("call, field", [
    (lambda cc: cc.save([0, 1], [5], [2]), "offsets[0]"),  # half a block
    (lambda cc: cc.save(list(range(2, 6)), [5], [4]), "inside a block"),  # unaligned
    (lambda cc: cc.save([3, 2, 1, 0], [5], [4]), "inside a block"),  # out of order
    (lambda cc: cc.save(list(range(8)), [5], [8]), "offsets[0]"),  # two blocks, one hash
    (lambda cc: cc.load(hashes=[5], chunk_descs=[[(0, 2)]]), "chunk_descs[0][0]"),
    (lambda cc: cc.load(hashes=[5], chunk_descs=[[(2, 4)]]), "inside a block"),
    (lambda cc: cc.exists([5], offsets=[3]), "offsets[0]"),
])
def test_a_token_inside_an_opaque_block_is_invalid(v1_cc, call, field):
    cc = v1_cc()
    cc.register_kvcache(vllm_cpu(), block_size=4)
    with pytest.raises(EmsException) as info:
        call(cc)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert field in info.value.message() and "opaque" in info.value.message()
    assert cc.statistics().objects == 0


def test_opaque_exists_with_offsets_and_a_paged_group_beside_it(v1_cc):
    cc = v1_cc()
    caches = vllm_cpu(nl=1) + [[torch.zeros(NB, 4, 2, 8), torch.zeros(NB, 4, 2, 8)]]
    cc.register_kvcache(caches, store_layer_group_desc=[[0], [1]], block_size=[4, None])
    assert cc.save(hashes=[1, 2], chunk_descs=[[(0, 4), (4, 4)], [(8, 4), (12, 2)]]
                   ).success == 2
    assert cc.exists([1, 2]).success == 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=0), "block_size"),
    (dict(block_size="4"), "block_size"),
    (dict(block_size=[4, 4]), "block_size"),
])
def test_invalid_block_size(v1_cc, kwargs, field):
    cc = v1_cc()
    with pytest.raises(EmsException) as info:
        cc.register_kvcache(vllm_cpu(), **kwargs)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert field in info.value.message()


def test_non_contiguous_pages_are_refused(v1_cc):
    cc = v1_cc()
    t = torch.empty(NB, 8, 2, 8).transpose(1, 2)  # a page whose dims are not contiguous
    with pytest.raises(EmsException) as info:
        cc.register_kvcache([[t]], block_size=4)
    assert "contiguous" in info.value.message()


def test_opaque_and_paged_registrations_have_other_keys(v1_cc):
    cc = v1_cc()
    caches = [[torch.ones(NB, 4, 2, 8)]]  # could be read either way
    cc.register_kvcache(caches)
    assert cc.save(slots_of([0], 4), [9], [4]).success == 1
    cc.register_kvcache(caches, block_size=4)
    assert cc.exists([9]).success == 0  # the opaque bytes are a layout of their own


# ----------------------------------------------------------------- meta layouts

def test_a_meta_layout_sees_what_the_real_layout_saved():
    """The scheduler process of an engine has no KV tensors: a meta registration of the
    same per-block shape computes the same keys (num_blocks is not part of them)."""
    cfg = CcConfig_v1(rank_id=0, device_id=0, model_id="m", llm_engine="vllm@x")
    worker, scheduler, close = _pair(cfg, cfg)
    try:
        real = vllm_cpu()
        worker.register_kvcache(real, block_size=4)
        meta = [[torch.empty(1, 2, 8, 8, device="meta")] for _ in range(2)]
        scheduler.register_kvcache(meta, block_size=4)
        assert worker.save(slots_of([0, 1], 4), [1, 2], [4, 4]).success == 2
        assert scheduler.exists([1, 2, 3]) == CcResult(2, 3)
        with pytest.raises(EmsException) as info:
            scheduler.load(slots_of([0], 4), [1], [4])
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "meta" in info.value.message()
    finally:
        close()


def test_a_meta_registration_never_replaces_real_memory(v1_cc):
    cc = v1_cc()  # single-process engines: both roles share one Ems
    real = vllm_cpu()
    cc.register_kvcache(real, block_size=4)
    cc.register_kvcache([[torch.empty(1, 2, 8, 8, device="meta")] for _ in range(2)],
                        block_size=4)
    assert cc.save(slots_of([0], 4), [1], [4]).success == 1  # still the real tensors
    assert cc.load(slots_of([3], 4), [1], [4]).success == 1


def test_meta_mixed_with_real_tensors_is_refused(v1_cc):
    cc = v1_cc()
    with pytest.raises(EmsException) as info:
        cc.register_kvcache([[torch.empty(NB, 4, 2, 8)],
                             [torch.empty(NB, 4, 2, 8, device="meta")]])
    assert "meta" in info.value.message()


@pytest.fixture
def v1_cc(make_cc):
    def make():
        return make_cc(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m",
                                                llm_engine="vllm@unit"))
    return make
