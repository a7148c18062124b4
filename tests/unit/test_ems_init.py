"""``Ems``: config validation (one row per rule of the spec), the init lifecycle and
pool selection from the environment."""

from __future__ import annotations

import time

import pytest

from ems import (
    CcConfig,
    CcConfig_v1,
    CcKvOption,
    Ems,
    EmsConfig,
    EmsErrorCode,
    EmsException,
    KVCacheType,
)

KEY32 = "A" * 32
GOOD_KEY = "0123456789abcdefABCDEF+/=" + "x" * 20


def cc0(**kw) -> CcConfig:
    base = dict(rank_id=0, device_id=0, model_id="llama2-13b")
    base.update(kw)
    return CcConfig(**base)


def cc1(**kw) -> CcConfig_v1:
    base = dict(rank_id=0, device_id=0, model_id="llama2-13b")
    base.update(kw)
    return CcConfig_v1(**base)


def with_attr(cfg, **attrs):
    for k, v in attrs.items():
        setattr(cfg, k, v)
    return cfg


# (id, config factory, a substring the message must contain: the field's name)
INVALID = [
    ("config-none", lambda: None, "config"),
    ("config-wrong-type", lambda: {"cc_config": cc0()}, "config"),
    # access_id / access_key
    ("key-without-id", lambda: EmsConfig(access_key=GOOD_KEY), "access_id"),
    ("id-empty", lambda: EmsConfig(access_id="", access_key=GOOD_KEY), "access_id"),
    ("id-newline", lambda: EmsConfig(access_id="a\nb", access_key=GOOD_KEY), "access_id"),
    ("id-nul", lambda: EmsConfig(access_id="a\x00", access_key=GOOD_KEY), "access_id"),
    ("id-surrogate", lambda: EmsConfig(access_id="a\ud800", access_key=GOOD_KEY),
     "access_id"),
    ("id-not-str-anonymous", lambda: EmsConfig(access_id=7, access_key=""), "access_id"),
    ("id-513", lambda: EmsConfig(access_id="a" * 513, access_key=GOOD_KEY), "access_id"),
    ("id-not-str", lambda: EmsConfig(access_id=123, access_key=GOOD_KEY), "access_id"),
    ("key-31", lambda: EmsConfig(access_id="t", access_key="A" * 31), "access_key"),
    ("key-257", lambda: EmsConfig(access_id="t", access_key="A" * 257), "access_key"),
    ("key-dash", lambda: EmsConfig(access_id="t", access_key=KEY32[:-1] + "-"), "access_key"),
    ("key-not-str", lambda: EmsConfig(access_id="t", access_key=10 ** 40), "access_key"),
    # CcConfig
    ("cc-wrong-type", lambda: EmsConfig(cc_config={"rank_id": 0}), "cc_config"),
    ("rank-negative", lambda: EmsConfig(cc_config=cc0(rank_id=-1)), "cc_config.rank_id"),
    ("rank-str", lambda: EmsConfig(cc_config=cc0(rank_id="0")), "cc_config.rank_id"),
    ("rank-float", lambda: EmsConfig(cc_config=cc0(rank_id=1.0)), "cc_config.rank_id"),
    ("rank-bool", lambda: EmsConfig(cc_config=cc0(rank_id=True)), "cc_config.rank_id"),
    ("rank-none", lambda: EmsConfig(cc_config=cc0(rank_id=None)), "cc_config.rank_id"),
    ("device-negative", lambda: EmsConfig(cc_config=cc0(device_id=-1)),
     "cc_config.device_id"),
    ("device-str", lambda: EmsConfig(cc_config=cc0(device_id="npu:1")),
     "cc_config.device_id"),
    ("model-empty", lambda: EmsConfig(cc_config=cc0(model_id="")), "cc_config.model_id"),
    ("model-tab", lambda: EmsConfig(cc_config=cc0(model_id="llama\t2")),
     "cc_config.model_id"),
    ("model-unit-separator", lambda: EmsConfig(cc_config=cc0(model_id="a\x1fb")),
     "cc_config.model_id"),
    ("model-513", lambda: EmsConfig(cc_config=cc0(model_id="m" * 513)), "cc_config.model_id"),
    ("model-not-str", lambda: EmsConfig(cc_config=cc0(model_id=13)), "cc_config.model_id"),
    ("model-none", lambda: EmsConfig(cc_config=cc0(model_id=None)), "cc_config.model_id"),
    ("tp-zero", lambda: EmsConfig(cc_config=cc0(tp_world_size=0)), "cc_config.tp_world_size"),
    ("tp-str", lambda: EmsConfig(cc_config=cc0(tp_world_size="2")),
     "cc_config.tp_world_size"),
    ("pp-zero", lambda: EmsConfig(cc_config=cc0(pp_world_size=0)), "cc_config.pp_world_size"),
    ("pp-negative", lambda: EmsConfig(cc_config=cc0(pp_world_size=-2)),
     "cc_config.pp_world_size"),
    # CcConfig_v1
    ("v1-plain-cc", lambda: EmsConfig(cc_config_v1=cc0()), "cc_config_v1"),
    ("v1-rank-negative", lambda: EmsConfig(cc_config_v1=cc1(rank_id=-1)),
     "cc_config_v1.rank_id"),
    ("v1-model", lambda: EmsConfig(cc_config_v1=cc1(model_id="m\r")), "cc_config_v1.model_id"),
    ("v1-tp-zero", lambda: EmsConfig(cc_config_v1=cc1(tp_world_size=0)),
     "cc_config_v1.tp_world_size"),
    ("v1-tp-rank-equal-tp", lambda: EmsConfig(cc_config_v1=cc1(tp_world_size=2,
                                                                rank_in_tp_group=2)),
     "cc_config_v1.rank_in_tp_group"),
    ("v1-tp-rank-negative", lambda: EmsConfig(cc_config_v1=cc1(rank_in_tp_group=-1)),
     "cc_config_v1.rank_in_tp_group"),
    ("v1-tp-rank-default-tp", lambda: EmsConfig(cc_config_v1=cc1(rank_in_tp_group=1)),
     "cc_config_v1.rank_in_tp_group"),
    ("v1-pp-rank-equal-pp", lambda: EmsConfig(cc_config_v1=cc1(pp_world_size=4,
                                                                rank_in_pp_group=4)),
     "cc_config_v1.rank_in_pp_group"),
    ("v1-pp-rank-str", lambda: EmsConfig(cc_config_v1=cc1(rank_in_pp_group="0")),
     "cc_config_v1.rank_in_pp_group"),
    ("v1-engine-empty", lambda: EmsConfig(cc_config_v1=cc1(llm_engine="")),
     "cc_config_v1.llm_engine"),
    ("v1-engine-not-str", lambda: EmsConfig(cc_config_v1=cc1(llm_engine=None)),
     "cc_config_v1.llm_engine"),
    ("v1-engine-513", lambda: EmsConfig(cc_config_v1=cc1(llm_engine="e" * 513)),
     "cc_config_v1.llm_engine"),
    ("v1-engine-newline", lambda: EmsConfig(cc_config_v1=cc1(llm_engine="vllm\n@x")),
     "cc_config_v1.llm_engine"),
    ("v1-kvcache-type", lambda: EmsConfig(cc_config_v1=with_attr(cc1(), kvcache_type="XLA")),
     "cc_config_v1.kvcache_type"),
    ("v1-kvcache-type-lower", lambda: EmsConfig(cc_config_v1=cc1(kvcache_type="mla")),
     "cc_config_v1.kvcache_type"),
    ("v1-kvcache-type-none", lambda: EmsConfig(cc_config_v1=cc1(kvcache_type=None)),
     "cc_config_v1.kvcache_type"),
]


@pytest.mark.parametrize("make, field", [r[1:] for r in INVALID], ids=[r[0] for r in INVALID])
def test_invalid_config_is_rejected_naming_the_field(make, field):
    config = make()
    with pytest.raises(EmsException) as info:
        Ems.init(config)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert field in info.value.message(), info.value.message()
    assert Ems.get_cc() is None and Ems._transport is None
    # Before a successful init, check_health probes the pool init would use: the
    # embedded pool (these tests' EMS_POOL) is always healthy.
    assert Ems.check_health() is True


#: What the real EMS adapter ships (../shared/spec/API.md): these must pass.
ADAPTER_MODEL_ID = "cc_kvstore@_@ds_default_ns_001"
ADAPTER_ACCESS_ID = "ems@_@default_tenant"

VALID = [
    # the adapter's shipped defaults: an access_id with "@" and an empty access_key
    ("adapter-v0-defaults", lambda: EmsConfig(access_id=ADAPTER_ACCESS_ID, access_key="",
                                              cc_config=cc0(model_id=ADAPTER_MODEL_ID))),
    ("adapter-v1-defaults", lambda: EmsConfig(
        access_id=ADAPTER_ACCESS_ID, access_key="",
        cc_config_v1=cc1(model_id=ADAPTER_MODEL_ID, llm_engine="vllm@my-service"))),
    ("id-without-key", lambda: EmsConfig(access_id="tenant", cc_config=cc0())),
    ("empty-id-empty-key", lambda: EmsConfig(access_id="", access_key="", cc_config=cc0())),
    ("id-uppercase", lambda: EmsConfig(access_id="Tenant", access_key=GOOD_KEY)),
    ("id-at-colon-slash", lambda: EmsConfig(access_id="org/Team:A@svc", access_key=GOOD_KEY)),
    ("id-space", lambda: EmsConfig(access_id="a b", access_key=GOOD_KEY)),
    ("id-unicode", lambda: EmsConfig(access_id="租户-1", access_key=GOOD_KEY)),
    ("model-path", lambda: EmsConfig(cc_config=cc0(model_id="meta-llama/Llama-2-13b-hf:v2"))),
    ("model-uppercase", lambda: EmsConfig(cc_config=cc0(model_id="Llama2-13B"))),
    ("model-512-any", lambda: EmsConfig(cc_config=cc0(model_id="M@:/" * 128))),
    ("v1-engine-path", lambda: EmsConfig(cc_config_v1=cc1(llm_engine="vLLM/0.9@svc:8000"))),
    ("no-cc", lambda: EmsConfig()),
    ("seed-rank-8", lambda: EmsConfig(cc_config=cc0(rank_id=8))),
    ("id-min", lambda: EmsConfig(access_id="a", access_key=KEY32, cc_config=cc0())),
    ("id-charset-max", lambda: EmsConfig(access_id=("0-9._az" * 80)[:512],
                                         access_key=GOOD_KEY, cc_config=cc0())),
    ("key-256", lambda: EmsConfig(access_id="t", access_key="+/=" + "a" * 253)),
    ("model-512", lambda: EmsConfig(cc_config=cc0(model_id="m._-9" * 100 + "ab"))),
    ("tp-pp", lambda: EmsConfig(cc_config=cc0(tp_world_size=8, pp_world_size=2))),
    ("v1", lambda: EmsConfig(cc_config_v1=cc1(tp_world_size=4, rank_in_tp_group=3,
                                             pp_world_size=2, rank_in_pp_group=1,
                                             llm_engine="vllm@my-service"))),
    ("v1-mla-str", lambda: EmsConfig(cc_config_v1=cc1(kvcache_type="MLA"))),
    ("v1-mla-attr", lambda: EmsConfig(cc_config_v1=with_attr(cc1(),
                                                             kvcache_type=KVCacheType.MLA))),
    ("v0-and-v1", lambda: EmsConfig(cc_config=cc0(), cc_config_v1=cc1())),
]


@pytest.mark.parametrize("make", [r[1] for r in VALID], ids=[r[0] for r in VALID])
def test_valid_config_is_accepted(make):
    config = make()
    Ems.init(config)
    assert Ems.check_health() is True
    has_cc = config.cc_config is not None or config.cc_config_v1 is not None
    assert (Ems.get_cc() is not None) is has_cc


def test_kvcache_type_string_is_normalised_to_the_enum():
    cfg = cc1(kvcache_type="GQA")
    Ems.init(EmsConfig(cc_config_v1=cfg))
    assert cfg.kvcache_type is KVCacheType.GQA


def test_get_cc_and_health_before_init():
    assert Ems.get_cc() is None
    assert Ems.check_health() is True  # the embedded pool that init would use


def test_health_before_init_probes_the_daemon_init_would_use(monkeypatch, tmp_path):
    monkeypatch.setenv("EMS_POOL", "server")
    monkeypatch.setenv("EMS_SOCKET_DIR", str(tmp_path))
    t0 = time.monotonic()
    assert Ems.check_health() is False  # no daemon socket: never raises, bounded
    assert time.monotonic() - t0 < 2.0
    monkeypatch.setenv("EMS_POOL", "nonsense")  # a bad environment: False, no raise
    assert Ems.check_health() is False


def test_anonymous_with_access_id_logs_one_info_line(caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="ems.client.singleton"):
        Ems.init(EmsConfig(access_id=ADAPTER_ACCESS_ID, access_key="", cc_config=cc0()))
    lines = [r.getMessage() for r in caplog.records if "anonymous" in r.getMessage()]
    assert len(lines) == 1 and ADAPTER_ACCESS_ID in lines[0]


def test_embedded_namespaces_of_ids_with_slashes_do_not_overlap(monkeypatch):
    from ems.client.singleton import open_transport
    from ems.config import PoolSettings

    settings = PoolSettings.from_env()
    a = open_transport(settings, EmsConfig(access_id="a", access_key=GOOD_KEY))
    ab = open_transport(settings, EmsConfig(access_id="a/b", access_key=GOOD_KEY))
    try:  # tenant "a" key "b/k" and tenant "a/b" key "k" are different storage keys
        assert a._key("b/k") != ab._key("k")
        assert a._key("k") != ab._key("k")
    finally:
        a.close()
        ab.close()


def test_init_is_retryable_after_a_failure():
    with pytest.raises(EmsException):
        Ems.init(EmsConfig(cc_config=cc0(rank_id=-1)))
    Ems.init(EmsConfig(cc_config=cc0()))
    assert Ems.get_cc() is not None


def test_init_is_retryable_after_a_pool_failure(monkeypatch):
    monkeypatch.setenv("EMS_POOL", "nonsense")
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=cc0()))
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "EMS_POOL" in info.value.message()
    assert Ems.get_cc() is None
    monkeypatch.setenv("EMS_POOL", "embedded")
    Ems.init(EmsConfig(cc_config=cc0()))
    assert Ems.get_cc() is not None


def test_same_config_twice_is_a_no_op():
    Ems.init(EmsConfig(cc_config=cc0()))
    cc = Ems.get_cc()
    Ems.init(EmsConfig(cc_config=cc0()))  # equal, not identical
    assert Ems.get_cc() is cc


def test_different_config_is_already_initialized():
    Ems.init(EmsConfig(cc_config=cc0()))
    cc = Ems.get_cc()
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=cc0(rank_id=1)))
    assert info.value.status_code() is EmsErrorCode.EMS_ALREADY_INITIALIZED
    assert Ems.get_cc() is cc and Ems.check_health()


def test_invalid_config_after_init_keeps_the_session():
    Ems.init(EmsConfig(cc_config=cc0()))
    cc = Ems.get_cc()
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=cc0(model_id="")))
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert Ems.get_cc() is cc


def test_finalize_and_reinit():
    Ems.finalize()  # idempotent, also before init
    Ems.init(EmsConfig(cc_config=cc0()))
    old = Ems.get_cc()
    Ems.finalize()
    Ems.finalize()
    assert Ems.get_cc() is None and Ems._transport is None
    # the old object refuses work with a clear error
    with pytest.raises(EmsException) as info:
        old.save(CcKvOption(), ["k"], [[__import__("ems").KvBufferWrapper(4096, 8)]])
    assert info.value.status_code() is EmsErrorCode.EMS_NOT_INITIALIZED
    Ems.init(EmsConfig(cc_config=cc0(rank_id=3)))
    assert Ems.get_cc() is not None and Ems.get_cc() is not old


def test_check_health_never_raises(monkeypatch):
    Ems.init(EmsConfig(cc_config=cc0()))
    transport = Ems.get_cc()._transport

    def boom():
        raise OSError("socket gone")

    monkeypatch.setattr(transport, "health", boom)
    assert Ems.check_health() is False


def test_server_mode_without_daemon_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("EMS_POOL", "server")
    monkeypatch.setenv("EMS_SOCKET_DIR", str(tmp_path))
    monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "500")
    start = time.monotonic()
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=cc0()))
    assert time.monotonic() - start < 10
    # not reachable *yet*: the code on which real clients retry init from their
    # health check
    assert info.value.status_code() is EmsErrorCode.EMS_RECOVERD_ERROR
    assert "check_health" in info.value.message()
    assert Ems.get_cc() is None and Ems.check_health() is False
    monkeypatch.setenv("EMS_POOL", "embedded")  # retry on another pool works
    Ems.init(EmsConfig(cc_config=cc0()))
    assert Ems.check_health()


def test_auto_mode_without_socket_uses_the_embedded_pool(monkeypatch, tmp_path):
    monkeypatch.setenv("EMS_POOL", "auto")
    monkeypatch.setenv("EMS_SOCKET_DIR", str(tmp_path / "absent"))
    Ems.init(EmsConfig(cc_config=cc0()))
    assert Ems.get_cc()._transport.kind == "embedded"


@pytest.mark.parametrize("var, value", [
    ("EMS_POOL", "bogus"),
    ("EMS_CAPACITY", "lots"),
    ("EMS_CAPACITY", "0"),
    ("EMS_WORKERS", "0"),
    ("EMS_WORKERS", "four"),
    ("EMS_CONNECT_TIMEOUT_MS", "-1"),
    ("EMS_SPIN_US", "-1"),
    ("EMS_SPIN_US", "fast"),
    ("EMS_SPIN_US", "2000000"),
    ("EMS_CUDA_REGISTER", "maybe"),
    ("EMS_CUDA_STAGING", "big"),
])
def test_bad_environment_is_invalid(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=cc0()))
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert var in info.value.message()
    assert Ems.get_cc() is None


@pytest.mark.parametrize("value, expected", [(None, 200), ("0", 0), ("1500", 1500)])
def test_spin_comes_from_the_environment(monkeypatch, value, expected):
    from ems.config import PoolSettings

    env = {} if value is None else {"EMS_SPIN_US": value}
    assert PoolSettings.from_env(env).spin_us == expected


@pytest.mark.parametrize("env, register, staging", [
    ({}, True, 32 << 20), ({"EMS_CUDA_REGISTER": "0"}, False, 32 << 20),
    ({"EMS_CUDA_REGISTER": "1", "EMS_CUDA_STAGING": "64M"}, True, 64 << 20),
])
def test_gpu_settings_come_from_the_environment(env, register, staging):
    from ems.config import PoolSettings

    s = PoolSettings.from_env(env)
    assert (s.cuda_register, s.cuda_staging_bytes) == (register, staging)


def test_init_hands_the_gpu_settings_to_the_cuda_module(monkeypatch):
    from ems.client import cuda

    monkeypatch.setenv("EMS_POOL", "embedded")
    monkeypatch.setenv("EMS_CUDA_REGISTER", "0")
    monkeypatch.setenv("EMS_CUDA_STAGING", "8M")
    monkeypatch.setattr(cuda, "_settings", cuda.GpuSettings())
    Ems.init(EmsConfig(cc_config=cc0()))
    assert cuda.settings() == cuda.GpuSettings(register=False, staging_bytes=8 << 20)


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("1k", 1024), ("1M", 1 << 20), ("64m", 64 << 20), ("2G", 2 << 30),
    ("512MiB", 512 << 20), ("3 mb", 3 << 20), (123, 123),
])
def test_parse_bytes(text, expected):
    from ems.config import parse_bytes

    assert parse_bytes(text) == expected


def test_capacity_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("EMS_CAPACITY", "2M")
    Ems.init(EmsConfig(cc_config=cc0()))
    assert Ems.get_cc().statistics().capacity_bytes == 2 << 20

