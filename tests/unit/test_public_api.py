"""The public surface is pinned: names, aliases, compatibility import paths, and the
promise that the core SDK imports and runs V0 without torch."""

from __future__ import annotations

import enum
import pickle
import subprocess
import sys
import textwrap
import types

import pytest

import ems
from ems import CcResult, EmsErrorCode, EmsException

PUBLIC = [
    "CcConfig",
    "CcConfig_v1",
    "CcFuture",
    "CcKvOption",
    "CcResult",
    "ContextCache_v1",
    "ContextCaching",
    "Ems",
    "EmsConfig",
    "EmsErrorCode",
    "EmsException",
    "KVCacheType",
    "KvBufferWrapper",
    "PrimaryKey",
]


def test_all_is_the_exact_sorted_public_list():
    assert ems.__all__ == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(ems, name) is not None


def test_no_other_public_names_leak_from_the_package():
    # subpackages and modules appear as attributes once imported; nothing else may
    leaked = {n for n, v in vars(ems).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert leaked == set(PUBLIC)


def test_context_cache_v1_alias():
    assert ems.ContextCache_v1 is ems.ContextCaching


def test_original_import_paths():
    from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
    from ems.common.exception import EmsErrorCode as Code2
    from ems.common.exception import EmsException as Exc2

    assert Code2 is EmsErrorCode and Exc2 is EmsException
    assert KVCacheType is ems.KVCacheType and CcConfig_v1 is ems.CcConfig_v1


def test_kvcache_type_is_a_str_enum():
    from ems.cc_v1.cc_config import KVCacheType

    assert issubclass(KVCacheType, str) and issubclass(KVCacheType, enum.Enum)
    assert sorted(m.name for m in KVCacheType) == ["GQA", "MHA", "MLA", "MQA"]
    assert KVCacheType.MLA == "MLA" and KVCacheType("MHA") is KVCacheType.MHA
    assert ems.CcConfig_v1(0, 0, "m").kvcache_type is KVCacheType.MHA


def test_error_codes_clients_compare_against():
    for name in ("EMS_INVALID_ARGUMENT", "EMS_INTERNAL_ERROR", "EMS_RECOVERD_ERROR",
                 "EMS_IO_TIMEOUT", "EMS_NOT_INITIALIZED", "EMS_ALREADY_INITIALIZED",
                 "EMS_UNAVAILABLE", "EMS_AUTH_FAILED", "EMS_NO_SPACE"):
        assert isinstance(EmsErrorCode[name], EmsErrorCode)
    values = [c.value for c in EmsErrorCode]
    assert len(values) == len(set(values))


def test_every_code_has_a_meaning():
    from ems.errors import ERROR_MEANINGS

    assert set(ERROR_MEANINGS) == set(EmsErrorCode)
    assert all(ERROR_MEANINGS.values())


def test_exception_accessors_str_and_pickle():
    e = EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "key_list must not be empty")
    assert isinstance(e, Exception)
    assert e.message() == "key_list must not be empty"
    assert e.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert e.status_code().name == "EMS_INVALID_ARGUMENT"
    assert str(e) == "EMS_INVALID_ARGUMENT: key_list must not be empty"
    assert f"{e}".startswith("EMS_INVALID_ARGUMENT")
    assert "EMS_INVALID_ARGUMENT" in repr(e)
    again = pickle.loads(pickle.dumps(e))
    assert again.status_code() is e.status_code() and again.message() == e.message()
    with pytest.raises(ValueError):
        EmsException(12345, "no such code")  # type: ignore[arg-type]


def test_exception_from_wire_value():
    e = EmsException(EmsErrorCode.EMS_IO_TIMEOUT.value, "late")  # type: ignore[arg-type]
    assert e.status_code() is EmsErrorCode.EMS_IO_TIMEOUT


def test_cc_result_is_readable_and_comparable():
    r = CcResult(2, 3)
    assert (r.success, r.total) == (2, 3)
    assert str(r) == repr(r) == "CcResult(success=2, total=3)"
    assert r == CcResult(2, 3) and r != CcResult(3, 3)
    assert len({r, CcResult(2, 3)}) == 1


def test_config_reprs_never_show_the_secret():
    key = "A" * 40
    cfg = ems.EmsConfig(access_id="tenant", access_key=key,
                        cc_config=ems.CcConfig(0, 0, "m"))
    assert key not in repr(cfg) and "tenant" in repr(cfg)
    assert "CcConfig(rank_id=0" in repr(cfg)
    assert "timeout=5000" in repr(ems.CcKvOption())
    assert "PrimaryKey('a', 'b')" == repr(ems.PrimaryKey("a", "b"))
    assert "length=8" in repr(ems.KvBufferWrapper(4096, 8))


def test_option_defaults():
    o = ems.CcKvOption()
    assert (o.write_rcache, o.read_local_only, o.timeout) == (True, False, 5000)
    c = ems.CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
    assert (c.tp_world_size, c.pp_world_size) == (1, 1)


_NO_TORCH = textwrap.dedent("""
    import ctypes, sys
    sys.modules["torch"] = None  # any "import torch" now raises ImportError
    import ems
    from ems import (CcConfig, CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsErrorCode,
                     EmsException, KvBufferWrapper, PrimaryKey)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"),
                       cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    src = (ctypes.c_ubyte * 96)(*range(96))
    dst1, dst2 = (ctypes.c_ubyte * 32)(), (ctypes.c_ubyte * 64)()
    opt = CcKvOption(timeout=5000)
    keys = ["plain", PrimaryKey("d", "a")]
    vals = [[KvBufferWrapper(ctypes.addressof(src), 32)],
            [KvBufferWrapper(ctypes.addressof(src) + 32, 64)]]
    assert cc.save(opt, keys, vals).success == 2
    r = cc.load(opt, keys, [[KvBufferWrapper(ctypes.addressof(dst1), 32)],
                            [KvBufferWrapper(ctypes.addressof(dst2), 64)]])
    assert (r.success, r.total) == (2, 2), r
    assert bytes(dst1) + bytes(dst2) == bytes(src)
    assert cc.async_load(opt, keys[:1], vals[:1]).result().success == 1
    try:
        cc.register_kvcache([[object()]])
    except EmsException as e:
        assert e.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "torch" in e.message(), e.message()
    else:
        raise AssertionError("register_kvcache worked without torch")
    assert sys.modules["torch"] is None
    Ems.finalize()
    print("OK")
""")


def test_import_and_v0_work_without_torch():
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"


def test_plain_import_does_not_import_torch():
    code = "import sys, ems, ems.cc_v1.cc_config, ems.common.exception; " \
           "print('torch' in sys.modules, 'numpy' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
