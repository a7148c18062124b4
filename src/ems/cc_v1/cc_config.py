"""``from ems.cc_v1.cc_config import KVCacheType`` (original SDK path)."""

from ems.config import CcConfig_v1, KVCacheType

__all__ = ["CcConfig_v1", "KVCacheType"]
