"""A local disk store for KV values: region files of checksummed records, a checkpointed
index, recovery after a crash. A synchronous engine (``store.py``) that the daemon's
disk tier drives from its worker threads."""

from __future__ import annotations

from ems.disk.settings import DiskSettings
from ems.disk.stats import DiskStatistics, TenantStatistics
from ems.disk.store import DiskState, DiskStore, DiskStoreLocked, ReadResult, WriteResult

__all__ = ["DiskSettings", "DiskState", "DiskStatistics", "DiskStore", "DiskStoreLocked",
           "ReadResult", "TenantStatistics", "WriteResult"]
