"""ems: a KV-cache memory pool for LLM inference, with the EMS Context Caching SDK API.

Only the SDK's public names live here (the seeds' names, exactly)."""

from ems.client.context_caching import ContextCache_v1, ContextCaching
from ems.client.singleton import Ems
from ems.config import CcConfig, CcConfig_v1, CcKvOption, EmsConfig, KVCacheType
from ems.errors import EmsErrorCode, EmsException
from ems.futures import CcFuture, CcResult
from ems.keys import KvBufferWrapper, PrimaryKey

__version__ = "0.1.0"

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
