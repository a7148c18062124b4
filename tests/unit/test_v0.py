"""V0 (key lists): round trips, consecutive-success counting, misses that write
nothing, write-once, and the validation table of spec §5 (nothing is stored)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ems import CcKvOption, CcResult, Ems, EmsErrorCode, EmsException, KvBufferWrapper, PrimaryKey


def buf(arr) -> KvBufferWrapper:
    assert arr.flags["C_CONTIGUOUS"]
    return KvBufferWrapper(arr.ctypes.data, arr.nbytes)


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def save_keys(cc, option, keys, sizes, seed=0):
    values = [data(n, seed + i) for i, n in enumerate(sizes)]
    result = cc.save(option, keys, [[buf(v)] for v in values])
    assert result == CcResult(len(keys), len(keys))
    return values


# ----------------------------------------------------------------- round trips

@pytest.mark.parametrize("keys", [
    ["123", "66"],
    [PrimaryKey("1", "123"), PrimaryKey("1", "66")],
    ["plain", PrimaryKey("dist", "attr"), PrimaryKey("dist", "other")],
    ("tuple", "of", "keys"),
])
def test_round_trip(cc, option, keys):
    values = save_keys(cc, option, keys, [8 * (i + 1) for i in range(len(keys))])
    out = [np.zeros_like(v) for v in values]
    assert cc.load(option, keys, [[buf(o)] for o in out]) == CcResult(len(keys), len(keys))
    for v, o in zip(values, out):
        assert np.array_equal(v, o)


def test_async_round_trip(cc, option):
    keys = [PrimaryKey("2", "hello_world"), "k2"]
    values = [data(24, 1), data(40, 2)]
    fut = cc.async_save(option, keys, [[buf(v)] for v in values])
    assert fut.result() == CcResult(2, 2)
    out = [np.zeros(24, np.uint8), np.zeros(40, np.uint8)]
    fut = cc.async_load(option, keys, [[buf(o)] for o in out])
    assert fut.result() == CcResult(2, 2)
    assert all(np.array_equal(v, o) for v, o in zip(values, out))


def test_keyword_arguments(cc, option):
    v, o = data(16, 3), np.zeros(16, np.uint8)
    assert cc.save(option=option, key_list=["kw"], value_list=[[buf(v)]]).success == 1
    assert cc.load(value_list=[[buf(o)]], key_list=["kw"], option=option).success == 1
    assert np.array_equal(v, o)


def test_primary_key_parts_do_not_collide(cc, option):
    keys = [PrimaryKey("a", "bc"), PrimaryKey("ab", "c"), "abc", PrimaryKey("abc", "x")]
    values = save_keys(cc, option, keys, [16, 16, 16, 16], seed=10)
    for key, value in zip(keys, values):
        out = np.zeros(16, np.uint8)
        assert cc.load(option, [key], [[buf(out)]]).success == 1
        assert np.array_equal(out, value), key
    # an equal PrimaryKey (another instance) names the same value
    out = np.zeros(16, np.uint8)
    assert cc.load(option, [PrimaryKey("a", "bc")], [[buf(out)]]).success == 1


def test_value_is_the_concatenation_of_buffers(cc, option):
    whole = data(128, 5)
    parts = [whole[:16].copy(), whole[16:48].copy(), whole[48:].copy()]  # 3 buffers
    assert cc.save(option, ["multi"], [[buf(p) for p in parts]]).success == 1
    a, b = np.zeros(100, np.uint8), np.zeros(28, np.uint8)  # 2 buffers, other split
    assert cc.load(option, ["multi"], [[buf(a), buf(b)]]).success == 1
    assert np.array_equal(np.concatenate([a, b]), whole)
    # and into buffers of other dtypes, as K and V of several layers would be
    f32, i64 = np.zeros(8, np.float32), np.zeros(12, np.int64)
    assert cc.load(option, ["multi"], [[buf(f32), buf(i64)]]).success == 1
    assert f32.tobytes() + i64.tobytes() == whole.tobytes()


def test_success_counts_consecutive_hits_from_the_start(cc, option):
    keys = [f"blk{i}" for i in range(4)]
    stored = save_keys(cc, option, [keys[0], keys[1], keys[3]], [32, 32, 32], seed=20)
    out = [np.full(32, 7, np.uint8) for _ in keys]
    assert cc.load(option, keys, [[buf(o)] for o in out]) == CcResult(2, 4)
    assert np.array_equal(out[0], stored[0]) and np.array_equal(out[1], stored[1])
    # nothing after the first miss is copied: a prefix cache cannot use it
    assert (out[2] == 7).all() and (out[3] == 7).all()
    # the later key is still there
    assert cc.load(option, [keys[3]], [[buf(out[3])]]).success == 1
    assert np.array_equal(out[3], stored[2])


def test_exists_counts_leading_v0_keys_without_copying(cc, option):
    keys = ["e0", PrimaryKey("d", "e1"), "e2", "e3"]
    save_keys(cc, option, [keys[0], keys[1], keys[3]], [16, 16, 16], seed=40)
    assert cc.exists(keys, option) == CcResult(2, 4)
    assert cc.exists(keys[3:]) == CcResult(1, 1)
    assert cc.exists(["absent", keys[0]], option) == CcResult(0, 2)
    # with value_list: a key stored with another size does not count
    sized = [[buf(np.zeros(n, np.uint8))] for n in (16, 8)]
    assert cc.exists(keys[:2], option, value_list=sized) == CcResult(1, 2)
    with pytest.raises(EmsException) as err:
        cc.exists(keys[:2], option, offsets=[16, 16])
    assert err.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT


def test_first_key_missing_is_zero(cc, option):
    save_keys(cc, option, ["present"], [8])
    out = [np.zeros(8, np.uint8), np.zeros(8, np.uint8)]
    assert cc.load(option, ["absent", "present"], [[buf(o)] for o in out]) == CcResult(0, 2)


@pytest.mark.parametrize("lengths", [[63], [65], [32, 16], [64, 1]])
def test_load_with_another_total_length_is_a_miss_and_writes_nothing(cc, option, lengths):
    save_keys(cc, option, ["sized"], [64])
    out = [np.full(n, 0xAB, np.uint8) for n in lengths]
    assert cc.load(option, ["sized"], [[buf(o) for o in out]]) == CcResult(0, 1)
    assert all((o == 0xAB).all() for o in out)


def test_write_once_keeps_the_first_value(cc, option):
    first = save_keys(cc, option, ["once"], [32], seed=30)[0]
    second = data(32, 31)
    assert cc.save(option, ["once"], [[buf(second)]]) == CcResult(1, 1)
    out = np.zeros(32, np.uint8)
    assert cc.load(option, ["once"], [[buf(out)]]).success == 1
    assert np.array_equal(out, first)


def test_save_reports_the_prefix_when_a_key_cannot_be_stored(monkeypatch, make_cc, option):
    from ems import CcConfig

    monkeypatch.setenv("EMS_CAPACITY", "1M")
    cc = make_cc(cc_config=CcConfig(0, 0, "m"))
    small, huge, last = data(1024, 1), np.zeros(2 << 20, np.uint8), data(1024, 2)
    r = cc.save(option, ["small", "huge", "last"], [[buf(small)], [buf(huge)], [buf(last)]])
    assert r == CcResult(1, 3)  # no exception: partial failure is data
    out = np.zeros(1024, np.uint8)
    assert cc.load(option, ["last"], [[buf(out)]]).success == 1  # keys are independent
    assert cc.load(option, ["small", "huge"], [[buf(out)], [buf(huge)]]) == CcResult(1, 2)


def test_torch_tensors_and_the_seeds_data_ptr_without_parentheses(cc, option):
    torch = pytest.importorskip("torch")
    t1, t2 = torch.arange(2, dtype=torch.float32), torch.arange(6, dtype=torch.float32)
    n1, n2 = t1.numel() * t1.element_size(), t2.numel() * t2.element_size()
    # the seeds pass the bound method tensor.data_ptr, not its value
    vals = [[KvBufferWrapper(t1.data_ptr, n1)], [KvBufferWrapper(t2.data_ptr, n2)]]
    assert cc.save(option, [PrimaryKey("1", "123"), PrimaryKey("1", "66")], vals).success == 2
    o1, o2 = torch.zeros(2), torch.zeros(6)
    r = cc.load(option, [PrimaryKey("1", "123"), PrimaryKey("1", "66")],
                [[KvBufferWrapper(o1.data_ptr(), n1)], [KvBufferWrapper(o2.data_ptr(), n2)]])
    assert r == CcResult(2, 2)
    assert torch.equal(o1, t1) and torch.equal(o2, t2)


def test_ctypes_buffers(cc, option):
    src = (ctypes.c_char * 40)(*b"0123456789" * 4)
    dst = (ctypes.c_char * 40)()
    assert cc.save(option, ["ct"], [[KvBufferWrapper(ctypes.addressof(src), 40)]]).success
    assert cc.load(option, ["ct"], [[KvBufferWrapper(ctypes.addressof(dst), 40)]]).success
    assert dst.raw == src.raw


@pytest.mark.parametrize("opt", [
    CcKvOption(timeout=0),
    CcKvOption(write_rcache=False, read_local_only=True, timeout=3000),
    CcKvOption(timeout=10 ** 9),
])
def test_option_values_are_accepted(cc, opt):
    value, out = data(8, 40), np.zeros(8, np.uint8)
    assert cc.save(opt, ["opt"], [[buf(value)]]).success == 1
    assert cc.load(opt, ["opt"], [[buf(out)]]).success == 1
    assert np.array_equal(value, out)


def test_key_length_127_and_unicode_are_accepted(cc, option):
    keys = ["k" * 127, PrimaryKey("d" * 127, "a" * 127), "键值"]
    save_keys(cc, option, keys, [8, 8, 8])


# ----------------------------------------------------------------- validation

GOOD = np.arange(64, dtype=np.uint8)
PTR = GOOD.ctypes.data


def bw(ptr=PTR, length=64):
    return KvBufferWrapper(ptr, length)


def call(option=CcKvOption(), keys=None, values=None):
    keys = ["good", "k1"] if keys is None else keys
    values = [[bw()], [bw()]] if values is None else values
    return (option, keys, values)


# (id, positional args, substring naming the field)
V0_INVALID = [
    ("option-none", call(option=None), "option"),
    ("option-dict", call(option={"timeout": 5000}), "option"),
    ("option-str", call(option="5000"), "option"),
    ("timeout-negative", call(option=CcKvOption(timeout=-1)), "option.timeout"),
    ("timeout-float", call(option=CcKvOption(timeout=1.5)), "option.timeout"),
    ("timeout-str", call(option=CcKvOption(timeout="5000")), "option.timeout"),
    ("timeout-bool", call(option=CcKvOption(timeout=True)), "option.timeout"),
    ("timeout-none", call(option=CcKvOption(timeout=None)), "option.timeout"),
    ("write_rcache-int", call(option=CcKvOption(write_rcache=1)), "option.write_rcache"),
    ("read_local_only-none", call(option=CcKvOption(read_local_only=None)),
     "option.read_local_only"),
    ("write_out-str", call(option=CcKvOption(write_out="no")), "option.write_out"),
    ("keys-none", (CcKvOption(), None, [[bw()]]), "key_list"),
    ("keys-empty", call(keys=[], values=[]), "key_list"),
    ("keys-str", call(keys="ab", values=[[bw()], [bw()]]), "key_list"),
    ("keys-int", call(keys=["good", 5]), "key_list[1]"),
    ("keys-duplicate", call(keys=["good", "good"]), "unique"),
    ("keys-duplicate-primary", call(keys=[PrimaryKey("d", "a"), PrimaryKey("d", "a")]),
     "unique"),
    ("key-128", call(keys=["good", "x" * 128]), "key_list[1]"),
    ("key-empty", call(keys=["", "good"]), "key_list[0]"),
    ("distribute-empty", call(keys=[PrimaryKey("", "a"), "good"]),
     "key_list[0].distribute_key"),
    ("attribute-128", call(keys=["good", PrimaryKey("d", "a" * 128)]),
     "key_list[1].attribute_key"),
    ("distribute-int", call(keys=[PrimaryKey(1, "a"), "good"]), "key_list[0].distribute_key"),
    ("values-none", (CcKvOption(), ["good"], None), "value_list"),
    ("values-shorter", call(values=[[bw()]]), "value_list"),
    ("values-longer", call(values=[[bw()], [bw()], [bw()]]), "value_list"),
    ("values-empty-entry", call(values=[[bw()], []]), "value_list[1]"),
    ("values-not-nested", call(values=[bw(), bw()]), "value_list[0]"),
    ("buffer-tuple", call(values=[[bw()], [(PTR, 64)]]), "value_list[1][0]"),
    ("ptr-zero", call(values=[[bw()], [bw(ptr=0)]]), "value_list[1][0].data_ptr"),
    ("ptr-negative", call(values=[[bw(ptr=-4096)], [bw()]]), "value_list[0][0].data_ptr"),
    ("ptr-none", call(values=[[bw()], [bw(), bw(ptr=None)]]), "value_list[1][1].data_ptr"),
    ("ptr-str", call(values=[[bw(ptr=hex(PTR))], [bw()]]), "data_ptr"),
    ("ptr-float", call(values=[[bw(ptr=float(PTR))], [bw()]]), "data_ptr"),
    ("ptr-bool", call(values=[[bw(ptr=True)], [bw()]]), "data_ptr"),
    ("ptr-callable-zero", call(values=[[bw(ptr=lambda: 0)], [bw()]]), "data_ptr"),
    ("length-zero", call(values=[[bw()], [bw(length=0)]]), "value_list[1][0].length"),
    ("length-negative", call(values=[[bw(length=-8)], [bw()]]), "length"),
    ("length-float", call(values=[[bw(length=8.0)], [bw()]]), "length"),
    ("length-none", call(values=[[bw(length=None)], [bw()]]), "length"),
    ("length-bool", call(values=[[bw(length=True)], [bw()]]), "length"),
    ("too-many-args", call() + (None, None, None), "positional"),
]


@pytest.mark.parametrize("op", ["save", "load", "async_save", "async_load"])
@pytest.mark.parametrize("args, field", [r[1:] for r in V0_INVALID],
                         ids=[r[0] for r in V0_INVALID])
def test_invalid_v0_call(cc, op, args, field):
    before = cc.statistics()
    with pytest.raises(EmsException) as info:
        getattr(cc, op)(*args)  # async calls raise at once, not from the future
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert field in info.value.message(), info.value.message()
    assert cc.statistics() == before  # nothing stored, nothing looked up
    out = np.zeros(64, np.uint8)
    assert cc.load(CcKvOption(), ["good"], [[buf(out)]]).success == 0


def test_unexpected_keyword_is_invalid(cc, option):
    with pytest.raises(EmsException) as info:
        cc.save(option, ["k"], [[bw()]], timeout=5)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "timeout" in info.value.message()
    with pytest.raises(EmsException) as info:
        cc.save(option, ["k"], [[bw()]], option=option)
    assert "option" in info.value.message()


def test_missing_arguments_are_invalid(cc, option):
    for args in [(), (option,), (option, ["k"])]:
        with pytest.raises(EmsException) as info:
            cc.save(*args)
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT


def test_calls_after_finalize_are_not_initialized(cc, option):
    Ems.finalize()
    for op in ("save", "load", "async_save", "async_load"):
        with pytest.raises(EmsException) as info:
            getattr(cc, op)(option, ["k"], [[bw()]])
        assert info.value.status_code() is EmsErrorCode.EMS_NOT_INITIALIZED


def test_an_option_with_v1_words_is_read_as_a_v1_call(cc, option):
    """A V1 word among the arguments makes the call V1 even when an option comes
    first (the V0 shortcut for ``save(option, keys, values)`` must not catch it)."""
    with pytest.raises(EmsException) as info:
        cc.save(option, slot_mapping=[0])
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "'slot_mapping' both by position and by name" in info.value.message()
    assert cc.statistics().objects == 0
