"""The SGLang backend's pure parts (no SGLang): settings, keys, host-pool regions."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from ems.errors import EmsErrorCode, EmsException
from ems.integrations.hicache import KV_POOL, EngineRank, HostPoolView, PageKeys
from ems.integrations.settings import StorageSettings

torch = pytest.importorskip("torch")

HASH = "ab" * 32  # SGLang's page hashes: sha256 hex digests
FMT = "page_first_direct/torch.bfloat16/16"


@dataclasses.dataclass
class FakeStorageConfig:
    """The fields of SGLang 0.5.23's HiCacheStorageConfig this backend reads."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: Optional[str] = "org/model"
    extra_config: Optional[dict] = None
    dcp_size: int = 1
    dcp_rank: int = 0


# ------------------------------------------------------------------ settings
def test_settings_pass_sglangs_keys_and_refuse_others() -> None:
    extra = {"backend_name": "ems", "module_path": "ems.integrations.sglang",
             "class_name": "EmsStorage", "interface_v1": 1, "pool": "server",
             "timeout_ms": 700}
    s = StorageSettings.from_sources(extra, env={})
    assert (s.pool, s.load_timeout_ms, s.save_timeout_ms) == ("server", 700, 700)
    with pytest.raises(EmsException) as err:
        StorageSettings.from_sources(dict(extra, time_out_ms=5), env={})
    assert err.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "time_out_ms" in str(err.value)
    assert "hicache_storage_backend_extra_config" in str(err.value)


def test_settings_extra_config_wins_over_the_environment() -> None:
    env = {"EMS_ACCESS_ID": "env-id", "EMS_ACCESS_KEY": "k" * 32,
           "EMS_SGLANG_LOOKUP_TIMEOUT_MS": "50"}
    s = StorageSettings.from_sources({"access_id": "mine"}, env=env)
    assert (s.access_id, s.access_key, s.lookup_timeout_ms) == ("mine", "k" * 32, 50)
    assert StorageSettings.from_sources({}, env={}).load_timeout_ms == 5000
    with pytest.raises(EmsException):
        StorageSettings.from_sources({"timeout_ms": 0}, env={})


def test_settings_openmp_warmup_is_a_checked_switch() -> None:
    assert StorageSettings.from_sources({}, env={}).openmp_warmup is True
    assert StorageSettings.from_sources({"openmp_warmup": False}, env={}).openmp_warmup \
        is False
    env = {"EMS_SGLANG_OPENMP_WARMUP": "0"}
    assert StorageSettings.from_sources({}, env=env).openmp_warmup is False
    with pytest.raises(EmsException) as err:
        StorageSettings.from_sources({"openmp_warmup": "maybe"}, env={})
    assert err.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "openmp_warmup" in str(err.value) and "true or false" in str(err.value)


def test_settings_write_out_sets_the_saves_option() -> None:
    """``write_out`` false in the extra config: every save keeps its pages in the
    pool's shared memory only (``CcKvOption.write_out``); loads are unchanged."""
    s = StorageSettings.from_sources({"write_out": False, "timeout_ms": 700}, env={})
    save, load = s.option("save"), s.option("load")
    assert (save.write_out, save.timeout, load.write_out, load.timeout) == (
        False, 700, True, 700)
    assert StorageSettings.from_sources({}, env={}).option("save").write_out is True
    with pytest.raises(EmsException) as err:
        StorageSettings.from_sources({"write_out": 2}, env={})
    assert "write_out" in str(err.value)


# ------------------------------------------------------------------ keys
def test_keys_carry_the_rank_suffix_sglang_requires() -> None:
    keys = [PageKeys.of(EngineRank.of(FakeStorageConfig(tp_rank=r, tp_size=2)), "m")
            for r in (0, 1)]
    k0, k1 = (k.key(HASH, KV_POOL, FMT) for k in keys)
    assert k0 != k1  # MHA: each TP rank its shard
    assert k0.startswith(HASH + "@") and k0.endswith(".tp0of2.pp0of1")
    pp = PageKeys.of(EngineRank.of(FakeStorageConfig(pp_rank=1, pp_size=2)), "m")
    cp = PageKeys.of(EngineRank.of(FakeStorageConfig(attn_cp_rank=1, attn_cp_size=2)), "m")
    other_model = PageKeys.of(EngineRank.of(FakeStorageConfig()), "m2")
    plain = PageKeys.of(EngineRank.of(FakeStorageConfig()), "m")
    assert len({k.key(HASH, KV_POOL, FMT) for k in (pp, cp, other_model, plain)}) == 4
    assert ".cp1of2" in cp.key(HASH, KV_POOL, FMT)
    swa = plain.key(HASH, "swa", FMT)
    assert swa != plain.key(HASH, KV_POOL, FMT) and swa.startswith(HASH + ".swa@")
    assert all(len(k.key(HASH, "auxiliary_swa", FMT)) < 128 for k in (pp, cp, plain))
    assert len(plain.key("f" * 200, KV_POOL, FMT)) < 128


def test_a_page_of_another_layout_or_dtype_has_another_key() -> None:
    keys = PageKeys.of(EngineRank.of(FakeStorageConfig()), "m")
    formats = ["layer_first/torch.bfloat16/16", "page_first/torch.bfloat16/16", FMT,
               "page_first_direct/torch.float16/16", "page_first_direct/torch.bfloat16/32"]
    assert len({keys.key(HASH, KV_POOL, f) for f in formats}) == len(formats)
    pool = PageFirstPool()
    assert HostPoolView.of(KV_POOL, pool).page_format == "page_first/torch.float32/4"


def test_mla_keys_are_shared_by_tp_ranks_but_mamba_state_is_not() -> None:
    ranks = [EngineRank.of(FakeStorageConfig(tp_rank=r, tp_size=2, is_mla_model=True))
             for r in (0, 1)]
    keys = [PageKeys.of(r, "m") for r in ranks]
    assert keys[0].key(HASH, KV_POOL, FMT) == keys[1].key(HASH, KV_POOL, FMT)
    assert ".tp" not in keys[0].key(HASH, KV_POOL, FMT)
    assert keys[0].key(HASH, "mamba", FMT) != keys[1].key(HASH, "mamba", FMT)
    assert [r.is_writer for r in ranks] == [True, False]
    assert not keys[0].tp_sharded(KV_POOL) and keys[0].tp_sharded("mamba")
    mha = EngineRank.of(FakeStorageConfig(tp_rank=1, tp_size=2))
    assert mha.is_writer and PageKeys.of(mha, "m").tp_sharded(KV_POOL)


def test_engine_rank_takes_the_defaults_of_missing_fields() -> None:
    @dataclasses.dataclass
    class Older:  # an SGLang without CP, DCP and model names
        tp_rank: int
        tp_size: int
        is_mla_model: bool
        model_name: Optional[str] = None

    r = EngineRank.of(Older(1, 4, False))
    assert (r.tp_rank, r.tp_size, r.attn_cp_size, r.dcp_size, r.model_name) == (1, 4, 1, 1, "")


# ------------------------------------------------------------------ host pool regions
class PageFirstPool:
    """SGLang's MHA host pool in its ``page_first`` layout: K then V buffers of
    ``[tokens, layers, heads, dim]``; ``get_page_buffer_meta`` as SGLang computes it."""

    layout = "page_first"
    dtype = torch.float32

    def __init__(self, tokens: int = 64, page_size: int = 4, layers: int = 2) -> None:
        self.page_size = page_size
        self.kv_buffer = torch.arange(2 * tokens * layers * 3 * 2, dtype=torch.float32
                                      ).reshape(2, tokens, layers, 3, 2)
        self.layers = layers

    def get_page_buffer_meta(self, indices):  # noqa: ANN001 - SGLang's signature
        row = self.layers * 3 * 2 * 4
        base, v_off = self.kv_buffer.data_ptr(), self.kv_buffer[1].data_ptr() - \
            self.kv_buffer.data_ptr()
        ptrs = []
        for i in range(0, len(indices), self.page_size):
            k = base + int(indices[i]) * row
            ptrs += [k, k + v_off]
        return ptrs, [row * self.page_size] * len(ptrs)


def test_host_pool_view_gives_each_page_its_k_and_v_regions() -> None:
    pool = PageFirstPool()
    view = HostPoolView.of(KV_POOL, pool)
    idx = torch.arange(8, 16)  # pages 2 and 3
    values = view.page_values(idx, 2)
    assert len(values) == 2 and all(len(v) == 2 for v in values)
    k_page3 = pool.kv_buffer[0, 12:16]
    assert values[1][0].data_ptr == k_page3.data_ptr()
    assert values[1][0].length == k_page3.numel() * 4
    assert values[1][1].data_ptr == pool.kv_buffer[1, 12:16].data_ptr()
    with pytest.raises(ValueError):
        view.page_values(torch.arange(8, 15), 2)  # not whole pages
