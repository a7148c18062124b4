"""The native copy's edges and the V1 run planning's helpers.

* The streaming copy prefetches a line of the next destination page: a copy that ends
  at the end of a mapping (the next page unmapped) must not fault, and every length
  (heads, tails, sub-page, multi-page) copies exactly its bytes.
* The copy function refuses what is not a run; V0 gives the same bytes on the native
  copy and on the fallback without it (memmove).
* ``_spread`` replaces ``repeat_interleave``: same result for any counts, zeros too.
"""

from __future__ import annotations

import ctypes
import mmap
import random

import pytest

from ems.client import native

torch = pytest.importorskip("torch")

PAGE = mmap.PAGESIZE


@pytest.fixture
def edge_map():
    """Two pages mapped, with the page after them unmapped (munmap'd): a write or a
    faulting read past the end would crash the test process."""
    mm = mmap.mmap(-1, 3 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = (ctypes.c_char * (3 * PAGE)).from_buffer(mm)
    base = ctypes.addressof(buf)
    libc = ctypes.CDLL(None)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert libc.munmap(base + 2 * PAGE, PAGE) == 0
    yield base, 2 * PAGE
    del buf
    mm.close()


@pytest.mark.skipif(not native.available(), reason="ems._native was not built")
@pytest.mark.parametrize("length", [1, 63, 4096, 4097, 5000, 2 * PAGE - 16, 2 * PAGE])
def test_copy_ending_at_the_end_of_a_mapping(edge_map, length):
    base, size = edge_map
    src = (ctypes.c_uint8 * size)(*[(i * 7 + 3) & 0xFF for i in range(size)])
    start = base + size - length  # the run ends exactly where the mapping ends
    ctypes.memset(base, 0, size)
    native.copy_one(start, ctypes.addressof(src), length)
    got = ctypes.string_at(start, length)
    assert got == bytes(src)[:length]
    assert ctypes.string_at(base, size - length) == b"\0" * (size - length)


@pytest.mark.skipif(not native.available(), reason="ems._native was not built")
def test_copy_runs_unaligned_heads_and_tails():
    rng = random.Random(5)
    src = bytes(rng.randrange(256) for _ in range(1 << 16))
    s = ctypes.create_string_buffer(src, len(src))
    d = ctypes.create_string_buffer(len(src) + 64)
    runs = [(3, 10, 9000), (9100, 9013, 4096), (20000, 20001, 17), (30001, 30005, 12345)]
    dst_t = torch.tensor([ctypes.addressof(d) + r[0] for r in runs], dtype=torch.int64)
    src_t = torch.tensor([ctypes.addressof(s) + r[1] for r in runs], dtype=torch.int64)
    native.copy_runs(dst_t, src_t, torch.tensor([r[2] for r in runs], dtype=torch.int64))
    out = d.raw
    for doff, soff, n in runs:
        assert out[doff:doff + n] == src[soff:soff + n]


def test_spread_equals_repeat_interleave():
    from ems.client.layout import _spread

    rng = random.Random(1)
    cases = [[2, 0, 3], [0, 0, 5, 0], [1], [16] * 64, [0, 4]]
    cases += [[rng.choice([0, 1, 2, 7, 16]) for _ in range(rng.randrange(1, 40))]
              for _ in range(50)]
    for counts in cases:
        if not sum(counts):
            continue
        c = torch.tensor(counts, dtype=torch.int64)
        owner, pos = _spread(torch, c)
        assert torch.equal(owner, torch.repeat_interleave(torch.arange(len(counts)), c))
        start = torch.repeat_interleave(torch.cumsum(c, 0) - c, c)
        assert torch.equal(pos, torch.arange(int(c.sum())) - start)


@pytest.mark.skipif(not native.available(), reason="ems._native was not built")
def test_the_copy_function_refuses_what_is_not_a_run():
    buf = ctypes.create_string_buffer(16)
    addr = ctypes.addressof(buf)
    with pytest.raises(TypeError):
        native.copy_one(addr, addr)
    with pytest.raises(TypeError):
        native.copy_one(addr, "0", 4)
    for bad in ((0, addr, 4), (addr, -1, 4), (addr, addr, -1)):
        with pytest.raises(ValueError):
            native.copy_one(*bad)
    with pytest.raises(OverflowError):
        native.copy_one(addr, addr, 1 << 70)


@pytest.mark.parametrize("copier", ["native", "memmove"])
@pytest.mark.parametrize("length", [4096, 1 << 20])  # with the GIL / without it
def test_v0_round_trip_on_both_host_copies(monkeypatch, cc, option, copier, length):
    """The native copy and the fallback without the helper (ctypes.memmove) give the
    same bytes through the SDK's V0 save and load."""
    import numpy as np

    from ems import KvBufferWrapper
    from ems.client import copy as host_copy
    if copier == "native" and not native.available():
        pytest.skip("ems._native was not built")
    monkeypatch.setattr(host_copy, "_host_copy",
                        native.copy_one if copier == "native" else ctypes.memmove)
    src = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert cc.save(option, ["k"], [[KvBufferWrapper(src.ctypes.data, length)]]).success == 1
    assert cc.load(option, ["k"], [[KvBufferWrapper(dst.ctypes.data, length)]]).success == 1
    assert np.array_equal(src, dst)
