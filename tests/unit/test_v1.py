"""V1 (paged KV cache): register_kvcache layouts, bit-exact round trips into other
blocks, partial blocks, layer groups with chunk_descs, exists, hash forms, the
storage key (MLA vs MHA, layout fingerprint) and the validation table."""

from __future__ import annotations

import pytest

from ems import CcConfig_v1, CcKvOption, CcResult, EmsErrorCode, EmsException, KVCacheType

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

NB, BS = 16, 4  # num_blocks, block_size of the default test caches


# ----------------------------------------------------------------- helpers

def randomize(t, seed: int) -> None:
    """Fill ``t`` (any strides) with random bits: compares below are bitwise."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                        generator=g)
    t.copy_(raw.view(t.dtype).view(t.shape))


def bits(t):
    return t.contiguous().view(torch.uint8)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def tokens(t, slots):
    """The rows of the tokens at ``slots`` (slot = block * block_size + pos)."""
    s = torch.as_tensor(slots)
    bs = t.shape[1]
    return t[s // bs, s % bs]


def blocks_slots(block_ids, bs=BS):
    return [b * bs + p for b in block_ids for p in range(bs)]


def all_tensors(caches):
    return [t for layer in caches for t in layer]


def zero(caches):
    for t in all_tensors(caches):
        t.zero_()


def only_these_slots_written(t, slots) -> bool:
    """Every token not in ``slots`` is still all-zero bytes."""
    mask = torch.ones(t.shape[0] * t.shape[1], dtype=torch.bool)
    mask[torch.as_tensor(slots)] = False
    rest = t.reshape(t.shape[0] * t.shape[1], -1) if t.is_contiguous() else \
        torch.stack([tokens(t, [s]).reshape(-1) for s in range(t.shape[0] * t.shape[1])])
    return bool((bits(rest[mask]) == 0).all())


def cfg_v1(**kw) -> CcConfig_v1:
    base = dict(rank_id=0, device_id=0, model_id="test-model", llm_engine="vllm@unit")
    base.update(kw)
    return CcConfig_v1(**base)


@pytest.fixture(params=["native", "torch"])
def copy_path(request, monkeypatch):
    """Run a test on both V1 copy paths of host tensors: the native bulk copy (where
    the extension is built) and torch's gather/scatter (the fallback)."""
    from ems.client import native

    if request.param == "native" and not native.available():
        pytest.skip("the native extension is not built here")
    if request.param == "torch":
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


@pytest.fixture
def v1(make_cc):
    """``v1(kv_caches, store_layer_group_desc=None, **config)`` -> registered cc."""
    def make(kv_caches, store_layer_group_desc=None, **config):
        cc = make_cc(cc_config_v1=cfg_v1(**config))
        cc.register_kvcache(kv_caches, store_layer_group_desc)
        return cc
    return make


# ----------------------------------------------------------------- layouts

def mha_4d(nl=2, h=2, d=8, dtype=torch.float16):
    return [[torch.empty(NB, BS, h, d, dtype=dtype) for _ in range(2)] for _ in range(nl)]


def mha_3d(nl=2, hd=16, dtype=torch.float32):
    return [[torch.empty(NB, BS, hd, dtype=dtype) for _ in range(2)] for _ in range(nl)]


def mla_bf16_fp16(nl=2):
    return [[torch.empty(NB, BS, 1, 16, dtype=torch.bfloat16),
             torch.empty(NB, BS, 1, 4, dtype=torch.float16)] for _ in range(nl)]


def mla_fp32_int8(nl=2):
    return [[torch.empty(NB, BS, 1, 8, dtype=torch.float32),
             torch.empty(NB, BS, 1, 3, dtype=torch.int8)] for _ in range(nl)]


def four_mixed(nl=2):
    return [[torch.empty(NB, BS, 2, 4, dtype=torch.float32),
             torch.empty(NB, BS, 2, 4, dtype=torch.bfloat16),
             torch.empty(NB, BS, 5, dtype=torch.int8),
             torch.empty(NB, BS, 1, 2, dtype=torch.float64)] for _ in range(nl)]


def sliced_kv(nl=2):
    """vLLM's layout: one [2, num_blocks, block_size, h, d] tensor per layer, K = kv[0]."""
    out = []
    for _ in range(nl):
        kv = torch.empty(2, NB, BS, 2, 8, dtype=torch.float16)
        out.append([kv[0], kv[1]])
    return out


def permuted(nl=2):
    """Dims 0 and 1 swapped in memory: [block_size, num_blocks, h, d] storage."""
    return [[torch.empty(BS, NB, 2, 4, dtype=torch.float32).permute(1, 0, 2, 3)
             for _ in range(2)] for _ in range(nl)]


LAYOUTS = {
    "mha-4d": mha_4d, "mha-3d": mha_3d, "mla-bf16-fp16": mla_bf16_fp16,
    "mla-fp32-int8": mla_fp32_int8, "four-mixed": four_mixed, "sliced-kv": sliced_kv,
    "permuted": permuted,
}

# (save slots, load slots, offsets): whole aligned blocks take the block path,
# anything else the token path.
SLOT_CASES = {
    "whole-blocks": (blocks_slots([1, 2, 3]), blocks_slots([9, 5, 12]), [BS] * 3),
    "partial-last": (blocks_slots([0, 1]) + [8, 9], blocks_slots([10, 4]) + [60, 61],
                     [BS, BS, 2]),
    "unaligned": (list(range(2, 2 + 3 * BS)), list(range(33, 33 + 3 * BS)), [BS] * 3),
    "scattered": ([5, 17, 2, 40, 41, 63, 0], [7, 3, 50, 1, 9, 8, 22], [3, 1, 3]),
}


@pytest.mark.parametrize("case", list(SLOT_CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_slot_mapping_round_trip_into_other_slots(copy_path, v1, idle, layout, case):
    caches = LAYOUTS[layout]()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    save_slots, load_slots, offsets = SLOT_CASES[case]
    hashes = [0x1000 + i for i in range(len(offsets))]
    expected = [tokens(t, save_slots).clone() for t in all_tensors(caches)]
    assert cc.save(save_slots, hashes, offsets) == CcResult(len(hashes), len(hashes))
    zero(caches)
    assert cc.load(load_slots, hashes, offsets) == CcResult(len(hashes), len(hashes))
    for t, want in zip(all_tensors(caches), expected):
        assert same_bits(tokens(t, load_slots), want)
        assert only_these_slots_written(t, load_slots)
    idle(cc)


@pytest.mark.parametrize("layout", ["mha-4d", "permuted", "mla-fp32-int8"])
def test_async_v1_and_keyword_forms(copy_path, v1, layout):
    caches = LAYOUTS[layout]()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, 100 + i)
    cc = v1(caches)
    opt = CcKvOption(timeout=5000)
    expected = [tokens(t, blocks_slots([0, 1])).clone() for t in all_tensors(caches)]
    f = cc.async_save(slot_mapping=blocks_slots([0, 1]), hashes=[1, 2], offsets=[BS, BS],
                      option=opt)
    assert cc.get_result(f) == CcResult(2, 2)
    zero(caches)
    f = cc.async_load(blocks_slots([6, 7]), [1, 2], [BS, BS], opt)
    assert f.result() == CcResult(2, 2)
    for t, want in zip(all_tensors(caches), expected):
        assert same_bits(tokens(t, blocks_slots([6, 7])), want)


def test_tensor_and_numpy_arguments(v1):
    np = pytest.importorskip("numpy")
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    slots = torch.tensor(blocks_slots([2, 3]), dtype=torch.int64)  # engines pass tensors
    assert cc.save(slots, np.array([7, 8], dtype=np.int64), torch.tensor([BS, BS])).success == 2
    assert cc.exists([7, 8]).success == 2


def test_slot_mapping_save_chunk_descs_load_interoperate(v1):
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    want = [tokens(t, blocks_slots([3, 4])).clone() for t in all_tensors(caches)]
    assert cc.save(blocks_slots([3, 4]), [0xABCD, 0x1234], [BS, BS]).success == 2
    zero(caches)
    r = cc.load(hashes=[0xABCD, 0x1234], chunk_descs=[[(0, BS), (BS, BS)]])
    assert r == CcResult(2, 2)
    for t, w in zip(all_tensors(caches), want):
        assert same_bits(tokens(t, blocks_slots([0, 1])), w)


def test_chunk_descs_with_two_layer_groups_of_different_block_sizes(copy_path, v1, idle):
    # layers 0 and 2: block_size 4, 16 blocks; layers 1 and 3: block_size 8, 6 blocks
    a = [[torch.empty(16, 4, 2, 8, dtype=torch.float16) for _ in range(2)] for _ in range(2)]
    b = [[torch.empty(6, 8, 32, dtype=torch.bfloat16),
          torch.empty(6, 8, 1, 8, dtype=torch.float32)] for _ in range(2)]
    caches = [a[0], b[0], a[1], b[1]]
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, 50 + i)
    cc = v1(caches, store_layer_group_desc=[[0, 2], [1, 3]])
    hashes = [-5, 2 ** 63 + 5, 77]
    save = [[(0, 4), (4, 4), (8, 2)], [(0, 8), (8, 8), (16, 5)]]
    load = [[(20, 4), (40, 4), (61, 2)], [(24, 8), (8, 8), (40, 5)]]

    def chunk_slots(descs):
        return [s for start, n in descs for s in range(start, start + n)]

    group_of = {0: 0, 2: 0, 1: 1, 3: 1}
    want = {}
    for li, layer in enumerate(caches):
        for ti, t in enumerate(layer):
            want[li, ti] = tokens(t, chunk_slots(save[group_of[li]])).clone()
    assert cc.save(hashes=hashes, chunk_descs=save) == CcResult(3, 3)
    zero(caches)
    assert cc.load(hashes=hashes, chunk_descs=load) == CcResult(3, 3)
    for li, layer in enumerate(caches):
        slots = chunk_slots(load[group_of[li]])
        for ti, t in enumerate(layer):
            assert same_bits(tokens(t, slots), want[li, ti]), (li, ti)
            assert only_these_slots_written(t, slots)
    # slot_mapping semantics applies the same slots to every group
    assert cc.exists(hashes).success == 3
    idle(cc)


def test_chunk_lengths_must_match_to_hit(v1):
    caches = mha_4d()
    cc = v1(caches)
    assert cc.save(hashes=[1, 2], chunk_descs=[[(0, 4), (4, 4)]]).success == 2
    zero(caches)
    randomize(caches[0][0][10:], 3)
    before = caches[0][0].clone()
    # block 2 was stored with 4 tokens: a 3-token load of it is a miss
    assert cc.load(hashes=[1, 2], chunk_descs=[[(40, 4), (44, 3)]]) == CcResult(1, 2)
    assert same_bits(tokens(caches[0][0], [44, 45, 46]), tokens(before, [44, 45, 46]))


def test_load_miss_writes_nothing_and_stops_at_the_hole(copy_path, v1):
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    assert cc.save(blocks_slots([0]), [1], [BS]).success == 1
    assert cc.save(blocks_slots([2]), [3], [BS]).success == 1
    before = [t.clone() for t in all_tensors(caches)]
    # hashes 1 hits, 2 misses, 3 would hit but comes after the hole
    r = cc.load(blocks_slots([8, 9, 10]), [1, 2, 3], [BS] * 3)
    assert r == CcResult(1, 3)
    for t, b in zip(all_tensors(caches), before):
        assert same_bits(t[9:11], b[9:11])  # blocks 9 and 10 untouched
        assert same_bits(t[8], b[0])
    assert cc.load(blocks_slots([11, 12]), [99, 1], [BS, BS]) == CcResult(0, 2)
    for t, b in zip(all_tensors(caches), before):
        assert same_bits(t[11:13], b[11:13])


def test_save_of_stored_blocks_counts_and_keeps_the_first(v1):
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    first = caches[0][0][0].clone()
    assert cc.save(blocks_slots([0]), [1], [BS]).success == 1
    assert cc.save(blocks_slots([1, 2]), [1, 2], [BS, BS]) == CcResult(2, 2)
    assert cc.load(blocks_slots([5]), [1], [BS]).success == 1
    assert same_bits(caches[0][0][5], first)


def test_exists_counts_leading_hits_without_copying(v1):
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    assert cc.save(blocks_slots([0, 1, 3]), [10, 11, 13], [BS] * 3).success == 3
    before = [t.clone() for t in all_tensors(caches)]
    stats = cc.statistics()
    assert cc.exists([10, 11, 12, 13]) == CcResult(2, 4)
    assert cc.exists([12, 10]) == CcResult(0, 2)
    assert cc.exists([10, 11], CcKvOption(timeout=10)) == CcResult(2, 2)
    assert cc.exists([10, 11], offsets=[BS, BS]).success == 2
    assert cc.exists([10, 11], offsets=[BS, 2]).success == 1  # stored with 4 tokens
    assert cc.exists([10], chunk_descs=[[(0, BS)]]).success == 1
    after = cc.statistics()
    assert (after.hits, after.misses, after.pinned) == (stats.hits, stats.misses, 0)
    for t, b in zip(all_tensors(caches), before):
        assert same_bits(t, b)


@pytest.mark.parametrize("error", [
    EmsException(EmsErrorCode.EMS_IO_ERROR, "connection reset"),
    RuntimeError("unexpected"),
    OSError("socket closed"),
])
def test_exists_answers_zero_when_the_pool_fails(v1, monkeypatch, error):
    cc = v1(mha_4d())
    assert cc.save(blocks_slots([0]), [1], [BS]).success == 1

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(cc._transport, "exists", broken)
    assert cc.exists([1, 2]) == CcResult(0, 2)


def test_exists_still_validates_its_input(v1):
    cc = v1(mha_4d())
    # (a list of str is a list of V0 keys: see test_v0's exists test)
    for bad, field in [([], "hashes"), ([1, 1], "unique"), ([1, "a"], "hashes"),
                       ([2 ** 64], "hashes[0]")]:
        with pytest.raises(EmsException) as info:
            cc.exists(bad)
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert field in info.value.message()
    with pytest.raises(EmsException) as info:
        cc.exists([1, 2], offsets=[BS])
    assert "offsets" in info.value.message()


def test_negative_and_unsigned_hashes_name_the_same_block(v1):
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    want = tokens(caches[1][1], blocks_slots([0, 1, 2])).clone()
    signed = [-1, -(2 ** 63), 2 ** 63 - 1]
    unsigned = [2 ** 64 - 1, 2 ** 63, 2 ** 63 - 1]
    assert cc.save(blocks_slots([0, 1, 2]), signed, [BS] * 3).success == 3
    assert cc.exists(unsigned).success == 3
    zero(caches)
    assert cc.load(blocks_slots([4, 5, 6]), unsigned, [BS] * 3).success == 3
    assert same_bits(tokens(caches[1][1], blocks_slots([4, 5, 6])), want)
    with pytest.raises(EmsException) as info:  # one block named twice
        cc.exists([-1, 2 ** 64 - 1])
    assert "unique" in info.value.message()


def _pair_on_one_pool(cfg_a, cfg_b, make_caches):
    """Two ranks' ContextCaching objects on one embedded pool (Ems is per process)."""
    from ems.client.context_caching import ContextCaching
    from ems.client.embedded import EmbeddedTransport

    transport = EmbeddedTransport(8 << 20)
    a = ContextCaching(transport, None, cfg_a)
    b = ContextCaching(transport, None, cfg_b)
    ca, cb = make_caches(), make_caches()
    for i, t in enumerate(all_tensors(ca)):
        randomize(t, i)
    zero(cb)
    a.register_kvcache(ca)
    b.register_kvcache(cb)

    def close():
        a.close()
        b.close()
        transport.close()
    return a, b, ca, cb, close


@pytest.mark.parametrize("kv_type", [KVCacheType.MLA, "MLA"])
def test_mla_keys_do_not_depend_on_the_tp_rank(kv_type):
    from ems.config import EmsConfig, validate_ems_config

    cfgs = [cfg_v1(tp_world_size=4, rank_in_tp_group=r, rank_id=r, kvcache_type=kv_type)
            for r in (0, 3)]
    for c in cfgs:  # Ems.init normalises kvcache_type; do the same here
        validate_ems_config(EmsConfig(cc_config_v1=c))
    a, b, ca, cb, close = _pair_on_one_pool(*cfgs, mla_bf16_fp16)
    try:
        assert a.save(blocks_slots([0, 1]), [5, 6], [BS, BS]).success == 2
        assert b.exists([5, 6]).success == 2
        assert b.save(blocks_slots([0, 1]), [5, 6], [BS, BS]).success == 2  # saved once
        assert b.load(blocks_slots([7, 8]), [5, 6], [BS, BS]).success == 2
        for ta, tb in zip(all_tensors(ca), all_tensors(cb)):
            assert same_bits(tb[7:9], ta[0:2])
        assert a.statistics().objects == 2
    finally:
        close()


@pytest.mark.parametrize("other", [
    dict(rank_in_tp_group=1),  # another TP rank holds other heads
    dict(rank_in_tp_group=0, tp_world_size=4),  # another TP degree
    dict(rank_in_pp_group=1),  # another pipeline stage
    dict(model_id="other-model"),
    dict(llm_engine="vllm@other-service"),
])
def test_mha_keys_depend_on_the_parallel_layout_and_model(other):
    base = dict(tp_world_size=2, pp_world_size=2, rank_in_tp_group=0, rank_in_pp_group=0)
    cfg_a = cfg_v1(**base)
    cfg_b = cfg_v1(**{**base, **other})
    a, b, ca, cb, close = _pair_on_one_pool(cfg_a, cfg_b, mha_4d)
    try:
        assert a.save(blocks_slots([0, 1]), [5, 6], [BS, BS]).success == 2
        assert b.exists([5, 6]).success == 0
        assert b.load(blocks_slots([7, 8]), [5, 6], [BS, BS]).success == 0
        assert all((bits(t) == 0).all() for t in all_tensors(cb))
    finally:
        close()


def test_same_layout_on_another_object_hits():
    """A restarted instance with the same layout hits its old blocks."""
    a, b, ca, cb, close = _pair_on_one_pool(cfg_v1(), cfg_v1(), mha_4d)
    try:
        assert a.save(blocks_slots([0]), [5], [BS]).success == 1
        assert b.load(blocks_slots([3]), [5], [BS]).success == 1
        assert same_bits(cb[0][0][3], ca[0][0][0])
    finally:
        close()


@pytest.mark.parametrize("other_layout", [
    lambda: mha_4d(dtype=torch.bfloat16),  # same bytes per token, other dtype
    lambda: mha_4d(d=16),  # other head size
    lambda: mha_4d(h=4, d=4),  # same token bytes, other shape
    lambda: mha_4d(nl=3),  # another number of layers
    lambda: [[t[..., :1, :].clone() for t in layer] for layer in mha_4d()],  # 1 head
    lambda: mha_4d()[:1] + mha_3d(nl=1, hd=16, dtype=torch.float16),  # 3-D second layer
])
def test_another_layout_misses_and_never_gets_foreign_bytes(v1, other_layout):
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    assert cc.save(blocks_slots([0, 1]), [1, 2], [BS, BS]).success == 2
    other = other_layout()
    zero(other)
    cc.register_kvcache(other)
    assert cc.exists([1, 2]).success == 0
    assert cc.load(blocks_slots([0, 1]), [1, 2], [BS, BS]) == CcResult(0, 2)
    assert all((bits(t) == 0).all() for t in all_tensors(other))
    cc.register_kvcache(caches)  # back to the first layout: hits again
    assert cc.exists([1, 2]).success == 2


def test_another_block_size_misses(v1):
    caches = mha_4d()
    cc = v1(caches)
    assert cc.save(blocks_slots([0]), [1], [BS]).success == 1
    cc.register_kvcache([[torch.zeros(8, 8, 2, 8, dtype=torch.float16)] * 2] * 2)
    assert cc.load(list(range(8)), [1], [8]).success == 0


# ----------------------------------------------------------------- validation

def test_v1_before_register_kvcache_is_invalid(make_cc):
    cc = make_cc(cc_config_v1=cfg_v1())
    calls = [
        lambda: cc.save(blocks_slots([0]), [1], [BS]),
        lambda: cc.load(blocks_slots([0]), [1], [BS]),
        lambda: cc.async_save(blocks_slots([0]), [1], [BS]),
        lambda: cc.async_load(hashes=[1], chunk_descs=[[(0, BS)]]),
        lambda: cc.exists([1]),
    ]
    for call in calls:
        with pytest.raises(EmsException) as info:
            call()
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "register_kvcache" in info.value.message()
    assert cc.statistics().objects == 0


GOOD_SLOTS, GOOD_HASHES, GOOD_OFFSETS = blocks_slots([0, 1]), [1, 2], [BS, BS]

# (id, kwargs of the call, substring naming the field)
V1_INVALID = [
    ("sum-offsets", dict(slot_mapping=GOOD_SLOTS[:-1], hashes=GOOD_HASHES,
                         offsets=GOOD_OFFSETS), "sum(offsets)"),
    ("sum-offsets-more", dict(slot_mapping=GOOD_SLOTS, hashes=GOOD_HASHES, offsets=[BS, 5]),
     "sum(offsets)"),
    ("len-offsets", dict(slot_mapping=GOOD_SLOTS, hashes=[1, 2, 3], offsets=GOOD_OFFSETS),
     "len(offsets)"),
    ("offset-zero", dict(slot_mapping=GOOD_SLOTS, hashes=[1, 2, 3], offsets=[BS, BS, 0]),
     "offsets[2]"),
    ("offset-negative", dict(slot_mapping=GOOD_SLOTS, hashes=[1, 2], offsets=[12, -4]),
     "offsets[1]"),
    ("slot-too-big", dict(slot_mapping=GOOD_SLOTS[:-1] + [NB * BS], hashes=GOOD_HASHES,
                          offsets=GOOD_OFFSETS), "slot_mapping"),
    ("slot-negative", dict(slot_mapping=[-1] + GOOD_SLOTS[1:], hashes=GOOD_HASHES,
                           offsets=GOOD_OFFSETS), "slot_mapping"),
    ("slot-float", dict(slot_mapping=[0.0] + GOOD_SLOTS[1:], hashes=GOOD_HASHES,
                        offsets=GOOD_OFFSETS), "slot_mapping"),
    ("slot-bool", dict(slot_mapping=[True] + GOOD_SLOTS[1:], hashes=GOOD_HASHES,
                       offsets=GOOD_OFFSETS), "slot_mapping"),
    ("slots-empty", dict(slot_mapping=[], hashes=GOOD_HASHES, offsets=GOOD_OFFSETS),
     "slot_mapping"),
    ("slots-not-list", dict(slot_mapping=5, hashes=[1], offsets=[1]), "slot_mapping"),
    ("hashes-empty", dict(slot_mapping=GOOD_SLOTS, hashes=[], offsets=GOOD_OFFSETS),
     "hashes"),
    ("hashes-none", dict(slot_mapping=GOOD_SLOTS, hashes=None, offsets=GOOD_OFFSETS),
     "hashes"),
    ("hashes-duplicate", dict(slot_mapping=GOOD_SLOTS, hashes=[1, 1], offsets=GOOD_OFFSETS),
     "unique"),
    ("hashes-str", dict(slot_mapping=GOOD_SLOTS, hashes=["1", "2"], offsets=GOOD_OFFSETS),
     "hashes"),
    ("hashes-bool", dict(slot_mapping=GOOD_SLOTS, hashes=[True, 2], offsets=GOOD_OFFSETS),
     "hashes"),
    ("hash-65-bits", dict(slot_mapping=GOOD_SLOTS, hashes=[1, 2 ** 64],
                          offsets=GOOD_OFFSETS), "hashes[1]"),
    ("hash-too-negative", dict(slot_mapping=GOOD_SLOTS, hashes=[-(2 ** 63) - 1, 2],
                               offsets=GOOD_OFFSETS), "hashes[0]"),
    ("both-semantics", dict(slot_mapping=GOOD_SLOTS, hashes=GOOD_HASHES,
                            offsets=GOOD_OFFSETS, chunk_descs=[[(0, BS), (BS, BS)]]),
     "chunk_descs"),
    ("neither-semantics", dict(hashes=GOOD_HASHES), "slot_mapping"),
    ("offsets-without-slots", dict(hashes=GOOD_HASHES, offsets=GOOD_OFFSETS),
     "slot_mapping"),
    ("chunk-groups", dict(hashes=GOOD_HASHES, chunk_descs=[[(0, 4), (4, 4)]] * 2),
     "len(chunk_descs)"),
    ("chunk-groups-zero", dict(hashes=GOOD_HASHES, chunk_descs=[]), "len(chunk_descs)"),
    ("chunk-per-hash", dict(hashes=GOOD_HASHES, chunk_descs=[[(0, 4)]]),
     "len(chunk_descs[0])"),
    ("chunk-past-end", dict(hashes=GOOD_HASHES, chunk_descs=[[(0, 4), (NB * BS - 2, 4)]]),
     "chunk_descs[0][1]"),
    ("chunk-negative-start", dict(hashes=GOOD_HASHES, chunk_descs=[[(-4, 4), (4, 4)]]),
     "chunk_descs[0][0]"),
    ("chunk-zero-length", dict(hashes=GOOD_HASHES, chunk_descs=[[(0, 4), (4, 0)]]),
     "chunk_descs[0][1]"),
    ("chunk-not-pair", dict(hashes=GOOD_HASHES, chunk_descs=[[(0, 4), (4, 4, 4)]]),
     "chunk_descs[0][1]"),
    ("chunk-float", dict(hashes=GOOD_HASHES, chunk_descs=[[(0, 4), (4.0, 4)]]),
     "chunk_descs[0][1]"),
    ("chunk-not-list", dict(hashes=GOOD_HASHES, chunk_descs="0,4"), "chunk_descs"),
    ("option-type", dict(slot_mapping=GOOD_SLOTS, hashes=GOOD_HASHES, offsets=GOOD_OFFSETS,
                         option={"timeout": 1}), "option"),
    ("option-timeout", dict(slot_mapping=GOOD_SLOTS, hashes=GOOD_HASHES, offsets=GOOD_OFFSETS,
                            option=CcKvOption(timeout=-1)), "option.timeout"),
    ("unknown-kwarg", dict(slot_mapping=GOOD_SLOTS, hashes=GOOD_HASHES, offsets=GOOD_OFFSETS,
                           block_size=BS), "block_size"),
]


@pytest.mark.parametrize("op", ["save", "load", "async_save", "async_load"])
@pytest.mark.parametrize("kwargs, field", [r[1:] for r in V1_INVALID],
                         ids=[r[0] for r in V1_INVALID])
def test_invalid_v1_call(v1, op, kwargs, field):
    caches = mha_4d()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    before_stats, before = cc.statistics(), [t.clone() for t in all_tensors(caches)]
    with pytest.raises(EmsException) as info:
        getattr(cc, op)(**kwargs)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert field in info.value.message(), info.value.message()
    assert cc.statistics() == before_stats
    assert all(same_bits(t, b) for t, b in zip(all_tensors(caches), before))
    assert cc.exists(GOOD_HASHES).success == 0


def test_too_many_positional_arguments(v1):
    cc = v1(mha_4d())
    with pytest.raises(EmsException) as info:
        cc.save(GOOD_SLOTS, GOOD_HASHES, GOOD_OFFSETS, None, None, None)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT


def _strided_token():
    return torch.empty(NB, BS, 8, 2).transpose(2, 3)  # per-token dims not contiguous


# (id, kv_caches factory, store_layer_group_desc, substring naming the field)
REGISTER_INVALID = [
    ("empty", lambda: [], None, "kv_caches"),
    ("not-list", lambda: torch.empty(NB, BS, 8), None, "kv_caches"),
    ("layer-is-tensor", lambda: [torch.empty(NB, BS, 8)], None, "kv_caches[0]"),
    ("layer-empty", lambda: [[torch.empty(NB, BS, 8)], []], None, "kv_caches[1]"),
    ("not-tensor", lambda: [[torch.empty(NB, BS, 8), "v"]], None, "kv_caches[0][1]"),
    ("2-d", lambda: [[torch.empty(NB, BS)]], None, "kv_caches[0][0]"),
    ("5-d", lambda: [[torch.empty(2, NB, BS, 2, 4)]], None, "kv_caches[0][0]"),
    ("zero-size", lambda: [[torch.empty(0, BS, 8)]], None, "kv_caches[0][0]"),
    ("token-dims-strided", lambda: [[_strided_token()]], None, "kv_caches[0][0]"),
    ("token-dim-strided-3d", lambda: [[torch.empty(NB, BS, 16)[:, :, ::2]]], None,
     "kv_caches[0][0]"),
    ("block-size-differs", lambda: [[torch.empty(NB, BS, 8), torch.empty(NB, 8, 8)]],
     None, "kv_caches[0][1]"),
    ("num-blocks-differs", lambda: [[torch.empty(NB, BS, 8)], [torch.empty(8, BS, 8)]],
     None, "kv_caches[1][0]"),
    ("groups-duplicate", lambda: mha_4d(), [[0], [0, 1]], "store_layer_group_desc[1]"),
    ("groups-missing", lambda: mha_4d(), [[0]], "store_layer_group_desc"),
    ("groups-out-of-range", lambda: mha_4d(), [[0, 2], [1]], "store_layer_group_desc[0]"),
    ("groups-negative", lambda: mha_4d(), [[-1], [0, 1]], "store_layer_group_desc[0]"),
    ("groups-empty-group", lambda: mha_4d(), [[0, 1], []], "store_layer_group_desc[1]"),
    ("groups-empty", lambda: mha_4d(), [], "store_layer_group_desc"),
    ("groups-float", lambda: mha_4d(), [[0.0, 1]], "store_layer_group_desc[0]"),
    ("groups-not-list", lambda: mha_4d(), "0,1", "store_layer_group_desc"),
]


@pytest.mark.parametrize("make, desc, field", [r[1:] for r in REGISTER_INVALID],
                         ids=[r[0] for r in REGISTER_INVALID])
def test_invalid_register_kvcache(make_cc, make, desc, field):
    cc = make_cc(cc_config_v1=cfg_v1())
    good = mha_4d()
    cc.register_kvcache(good)
    assert cc.save(blocks_slots([0]), [1], [BS]).success == 1
    with pytest.raises(EmsException) as info:
        cc.register_kvcache(make(), desc)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert field in info.value.message(), info.value.message()
    # a failed registration keeps the previous one
    assert cc.exists([1]).success == 1
    assert cc.load(blocks_slots([3]), [1], [BS]).success == 1


def test_one_layer_group_per_layer_and_scattered_groups(copy_path, v1):
    caches = mha_4d(nl=3)
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches, store_layer_group_desc=[[2], [0], [1]])
    want = [t[1].clone() for t in all_tensors(caches)]
    descs = [[(BS, BS)]] * 3
    assert cc.save(hashes=[9], chunk_descs=descs).success == 1
    zero(caches)
    assert cc.load(hashes=[9], chunk_descs=[[(0, BS)], [(2 * BS, BS)], [(3 * BS, BS)]]).success
    assert same_bits(caches[2][0][0], want[4]) and same_bits(caches[0][1][2], want[1])
    assert same_bits(caches[1][0][3], want[2])


def test_a_pool_of_odd_capacity(copy_path, monkeypatch, v1):
    """EMS_CAPACITY need not be a multiple of any dtype size."""
    monkeypatch.setenv("EMS_CAPACITY", "100001")
    caches = four_mixed()
    for i, t in enumerate(all_tensors(caches)):
        randomize(t, i)
    cc = v1(caches)
    want = [t[0:2].clone() for t in all_tensors(caches)]
    assert cc.save(blocks_slots([0, 1]), [1, 2], [BS, BS]).success == 2
    assert cc.load(blocks_slots([5, 6]), [1, 2], [BS, BS]).success == 2
    assert all(same_bits(t[5:7], w) for t, w in zip(all_tensors(caches), want))


def test_exists_warns_once_per_outage(v1, monkeypatch, caplog):
    import logging

    cc = v1(mha_4d())
    real = cc._transport.exists

    def broken(*args, **kwargs):
        raise EmsException(EmsErrorCode.EMS_IO_ERROR, "pool down")

    monkeypatch.setattr(cc._transport, "exists", broken)
    with caplog.at_level(logging.WARNING, logger="ems.client.context_caching"):
        for _ in range(50):  # a scheduler asks every step
            assert cc.exists([1]) == CcResult(0, 1)
        monkeypatch.setattr(cc._transport, "exists", real)
        assert cc.exists([1]) == CcResult(0, 1)  # back: a plain miss
        monkeypatch.setattr(cc._transport, "exists", broken)
        cc.exists([1])  # a new outage warns again
    warnings = [r for r in caplog.records if "exists failed" in r.getMessage()]
    assert len(warnings) == 2
