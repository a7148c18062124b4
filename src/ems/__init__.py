"""ems: a KV-cache memory pool for LLM inference, with the EMS Context Caching SDK API.

Only the SDK's public names live here (the seeds' names, exactly). They are imported on
first use (PEP 562), so ``import ems.server.daemon`` or ``import ems.protocol`` does not
load the SDK, torch checks or the client.
"""

import importlib as _importlib
import typing as _typing

from ems._version import __version__ as __version__

if _typing.TYPE_CHECKING:  # what a type checker and an IDE see; at run time: __getattr__
    from ems.client.context_caching import ContextCache_v1, ContextCaching
    from ems.client.singleton import Ems
    from ems.config import CcConfig, CcConfig_v1, CcKvOption, EmsConfig, KVCacheType
    from ems.errors import EmsErrorCode, EmsException
    from ems.futures import CcFuture, CcResult
    from ems.keys import KvBufferWrapper, PrimaryKey

#: public name -> the module that defines it
_WHERE = {
    "CcConfig": "ems.config",
    "CcConfig_v1": "ems.config",
    "CcFuture": "ems.futures",
    "CcKvOption": "ems.config",
    "CcResult": "ems.futures",
    "ContextCache_v1": "ems.client.context_caching",
    "ContextCaching": "ems.client.context_caching",
    "Ems": "ems.client.singleton",
    "EmsConfig": "ems.config",
    "EmsErrorCode": "ems.errors",
    "EmsException": "ems.errors",
    "KVCacheType": "ems.config",
    "KvBufferWrapper": "ems.keys",
    "PrimaryKey": "ems.keys",
}

__all__ = [
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


def __getattr__(name: str) -> "_typing.Any":
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ems' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> "list[str]":
    return sorted([*__all__, "__version__"])
