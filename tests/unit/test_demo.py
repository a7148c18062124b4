"""The ``ems demo``: paged model == dense model, block hashing, and a scaled-down run."""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import Future

import pytest

torch = pytest.importorskip("torch")

from ems import Ems  # noqa: E402
from ems.demo.connector import EmsConnector  # noqa: E402
from ems.demo.engine import Engine, Workload, make_workload  # noqa: E402
from ems.demo.model import LlamaModel, ModelConfig  # noqa: E402
from ems.demo.passes import compare  # noqa: E402
from ems.demo.runner import main  # noqa: E402
from ems.demo.scheduler import (  # noqa: E402
    BlockAllocator,
    NoFreeBlocks,
    block_hashes,
    slot_mapping,
)
from ems.futures import CcResult  # noqa: E402

pytestmark = pytest.mark.torch

SMALL = ["--prefixes", "2", "--requests", "3", "--prefix-tokens", "64", "--suffix-tokens",
         "20", "--decode-tokens", "3", "--layers", "2", "--hidden", "64", "--vocab", "256",
         "--block-size", "8", "--threads", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def _finalized():
    """Each test leaves Ems finalized and torch's thread count as it was (the
    embedded pool of conftest's ``_unit_env`` is what ``--instances`` refuses)."""
    threads = torch.get_num_threads()
    yield
    Ems.finalize()
    torch.set_num_threads(threads)


def _tiny_model() -> LlamaModel:
    return LlamaModel(ModelConfig.for_hidden(64, num_layers=2, vocab_size=128, seed=3))


def test_paged_forward_matches_dense_reference() -> None:
    model = _tiny_model()
    tokens = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(0))
    dense = model.forward_dense(tokens, last=6)
    kv = model.allocate_kv_cache(num_blocks=12, block_size=8)
    for layer in kv:  # unwritten slots must never be read
        for cache in layer:
            cache.fill_(float("nan"))
    table = torch.tensor([11, 3, 7, 0, 5, 9])  # scattered blocks, not in order
    # A chunked prefill (as after a load of 3 blocks), then single-token decode steps.
    model.forward_paged(tokens[:24], 0, table, kv)
    steps = [model.forward_paged(tokens[24:40], 24, table, kv)]
    for pos in range(40, 45):
        steps.append(model.forward_paged(tokens[pos:pos + 1], pos, table, kv))
    torch.testing.assert_close(torch.stack(steps), dense, atol=1e-5, rtol=1e-5)


def test_paged_forward_rejects_short_block_table() -> None:
    model = _tiny_model()
    kv = model.allocate_kv_cache(num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="cannot hold"):
        model.forward_paged(torch.arange(17), 0, torch.tensor([0, 1]), kv)


def test_block_hashes_are_chained_signed_and_stable() -> None:
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2  # the trailing 8 tokens are no full block
    first = hashlib.blake2b(struct.pack("<16q", *range(16)), digest_size=8).digest()
    assert hashes[0] == int.from_bytes(first, "little", signed=True)
    assert all(-(1 << 63) <= h < (1 << 63) for h in hashes)
    changed = block_hashes([1000] + tokens[1:], 16)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # a prefix hash
    assert block_hashes(tokens[:32], 16) == hashes
    assert block_hashes(tokens, 16, parent=7) != hashes


def test_slot_mapping_and_allocator() -> None:
    assert slot_mapping([5, 2, 9], 4, 1, 2) == [8, 9, 10, 11, 36, 37, 38, 39]
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert a == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(NoFreeBlocks):
        alloc.allocate(2)
    alloc.free(a[:2])
    assert alloc.allocate(3) == [3, 0, 1]  # FIFO: the freed blocks come back last


def test_demo_outputs_identical_and_later_requests_hit(tmp_path) -> None:
    out = tmp_path / "demo.json"
    assert main(SMALL + ["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["comparison"]["same_tokens"] == 6
    plain, cached = report["plain"]["requests"], report["ems"]["requests"]
    assert [r["output"] for r in plain] == [r["output"] for r in cached]
    for i, r in enumerate(cached):
        if i < 2:  # the first request of each prefix finds nothing
            assert r["loaded_tokens"] == 0 and r["computed_tokens"] == 84
        else:  # the 8 full blocks of the 64-token prefix come from the pool
            assert r["loaded_tokens"] == 64 and r["computed_tokens"] == 20
    assert report["connector"]["blocks_loaded"] == 4 * 8
    assert report["connector"]["errors"] == 0
    assert report["comparison"]["max_logit_diff"] <= 1e-4
    assert Ems.get_cc() is None  # the demo finalized


class _LyingCc:
    """Claims every block is cached and loaded, but writes nothing."""

    def register_kvcache(self, kv_caches) -> None:
        pass

    def exists(self, hashes, **kwargs) -> CcResult:
        return CcResult(len(hashes), len(hashes))

    def load(self, *, slot_mapping, hashes, offsets, option) -> CcResult:
        return CcResult(len(hashes), len(hashes))

    def async_save(self, *, slot_mapping, hashes, offsets, option) -> Future:
        future: Future = Future()
        future.set_result(CcResult(len(hashes), len(hashes)))
        return future


def test_a_load_that_writes_nothing_is_caught() -> None:
    """Freed blocks are poisoned, so stale KV cannot hide a broken load."""
    model = _tiny_model()
    requests = make_workload(Workload(1, 2, 32, 8, 2, seed=1), model.config.vocab_size)
    engine = Engine(model, num_blocks=12, block_size=8)
    plain = engine.run_all(requests)
    engine.reset()
    engine.attach(EmsConnector(_LyingCc(), block_size=8))
    lied = engine.run_all(requests)
    assert lied[0].loaded_tokens == 32
    assert not compare(plain, lied, atol=1e-4).ok


def test_instances_need_the_daemon(capsys) -> None:
    assert main(SMALL + ["--instances", "2"]) == 2
    assert "ems-server" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys) -> None:
    assert main(SMALL + ["--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err
