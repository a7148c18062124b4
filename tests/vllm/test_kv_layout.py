"""vLLM's cache layouts as ems registers them, and block keys (no vLLM needed)."""

from __future__ import annotations

import dataclasses

import pytest

from ems.integrations.kv_layout import (
    canonical_layer,
    chunk_descs,
    group_kind,
    identity_shape,
    is_mla,
    leading_identities,
    mirror_shapes,
    write_identities,
)

torch = pytest.importorskip("torch")

BS, HEADS, HEAD = 32, 2, 64


@dataclasses.dataclass
class FullAttentionSpec:  # the fields EmsConnector reads from vLLM's spec
    num_kv_heads: int = HEADS
    head_size: int = HEAD


class MLAAttentionSpec(FullAttentionSpec):
    pass


@pytest.mark.parametrize("shape", [(8, HEADS, BS, 2 * HEAD), (8, HEADS, 2 * BS, HEAD)])
def test_cpu_pages_are_one_opaque_page_per_block(shape):
    kv = torch.arange(8 * HEADS * 2 * BS * HEAD, dtype=torch.float32).reshape(shape)
    tensors, page = canonical_layer(kv, BS, FullAttentionSpec(), on_cpu=True)
    assert page == BS and len(tensors) == 1
    t = tensors[0]
    assert tuple(t.shape) == (8, HEADS, 2 * BS, HEAD)
    assert t.data_ptr() == kv.data_ptr() and torch.equal(t[3].flatten(), kv[3].flatten())
    want, want_page, mla = mirror_shapes(FullAttentionSpec(), BS, on_cpu=True)
    assert [tuple(t.shape[1:])] == want and want_page == page and not mla


def test_split_kv_layouts_are_two_paged_tensors():
    spec = FullAttentionSpec()
    want, page, _ = mirror_shapes(spec, BS, on_cpu=False)
    for kv, k0 in ((torch.zeros(2, 8, BS, HEADS, HEAD), lambda kv: kv[0]),
                   (torch.zeros(8, 2, BS, HEADS, HEAD), lambda kv: kv[:, 0])):
        tensors, got_page = canonical_layer(kv, BS, spec, on_cpu=False)
        assert got_page is None and page is None
        assert [tuple(t.shape[1:]) for t in tensors] == want
        assert tensors[0].data_ptr() == k0(kv).data_ptr()


def test_mla_is_one_paged_tensor_and_says_so():
    spec = MLAAttentionSpec(num_kv_heads=1, head_size=576)
    tensors, page = canonical_layer(torch.zeros(8, BS, 576), BS, spec, on_cpu=False)
    want, want_page, mla = mirror_shapes(spec, BS, on_cpu=False)
    assert mla and page is None and want_page is None
    assert [tuple(t.shape[1:]) for t in tensors] == want


def test_unknown_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        canonical_layer(torch.zeros(8, 3, BS, HEAD), BS, FullAttentionSpec(), on_cpu=False)


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_identity_pages_tell_a_block_from_another_prefixs(block_size):
    shape = identity_shape(block_size)
    assert shape[0] == block_size and shape[0] * shape[1] >= 32
    pages = torch.zeros((6, *shape), dtype=torch.uint8)
    mine = [bytes([i]) * 32 for i in range(1, 4)]
    write_identities(pages, [4, 1, 2], mine)
    assert leading_identities(pages, [4, 1, 2], mine) == 3
    other = [mine[0], b"\x09" * 32, mine[2]]  # block 1 under the same key: another's
    assert leading_identities(pages, [4, 1, 2], other) == 1
    # vLLM's null block is never read: not checked
    assert leading_identities(pages, [4, 0, 2], [mine[0], b"\x07" * 32, mine[2]]) == 3
    assert leading_identities(pages, [], []) == 0


def test_chunk_descs_are_whole_blocks_per_group():
    assert chunk_descs([[3, 1], [0, 5]], 4) == [[(12, 4), (4, 4)], [(0, 4), (20, 4)]]


class SlidingWindowSpec(FullAttentionSpec):
    pass


class MambaSpec:
    pass


def test_group_kinds_by_exact_type():
    assert group_kind(FullAttentionSpec()) == "full"
    assert group_kind(MLAAttentionSpec()) == "full"
    assert group_kind(SlidingWindowSpec()) == "window"
    assert group_kind(MambaSpec()) is None

    class RSWASpec(FullAttentionSpec):  # a subclass with its own semantics
        pass
    assert group_kind(RSWASpec()) is None


def test_mla_by_exact_spec_type():
    assert is_mla(MLAAttentionSpec()) and not is_mla(FullAttentionSpec())

    class HiddenStateCacheSpec(MLAAttentionSpec):  # vLLM's subclass: another cache
        pass

    class MLAFutureSpec(FullAttentionSpec):  # a prefix is not a type
        pass
    assert not is_mla(HiddenStateCacheSpec()) and not is_mla(MLAFutureSpec())
    assert mirror_shapes(HiddenStateCacheSpec(), BS, on_cpu=False)[2] is False
