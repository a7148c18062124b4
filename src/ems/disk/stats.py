"""The disk store's statistics as values (a frozen snapshot per call)."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional

__all__ = ["DiskStatistics", "LatencyWindow", "TenantStatistics"]


class LatencyWindow:
    """The last ``size`` latencies (seconds); quantiles over them."""

    def __init__(self, size: int = 4096) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)

    def quantile(self, q: float) -> Optional[float]:
        with self._lock:
            xs = sorted(self._samples)
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass(frozen=True)
class TenantStatistics:
    tenant: str
    objects: int
    #: bytes of the tenant's live values
    value_bytes: int
    #: bytes its regions occupy (what the quota bounds)
    disk_bytes: int
    quota_bytes: Optional[int]


@dataclass(frozen=True)
class DiskStatistics:
    state: str  # "recovering" | "ok" | "off"
    capacity_bytes: int
    used_bytes: int
    objects: int
    regions: int
    tenants: tuple[TenantStatistics, ...]
    writes: int
    bytes_written: int
    reads: int
    hits: int
    misses: int
    bytes_read: int
    read_damaged: int
    read_io_errors: int
    read_timeouts: int
    write_latency_p50_s: Optional[float]
    write_latency_p99_s: Optional[float]
    read_latency_p50_s: Optional[float]
    read_latency_p99_s: Optional[float]
    refused_no_space: int
    refused_quota: int
    refused_budget: int
    refused_io_error: int
    refused_too_large: int
    regions_evicted: int
    records_recovered: int
    records_scanned: int
    records_dropped_damaged: int
    recovery_s: float
    scan_skipped: bool
    checkpoints: int
    last_checkpoint_age_s: Optional[float]
    #: whether the filesystem accepts O_DIRECT, and how many transfers used it (a write
    #: is one batch: one write buffer's pwritev)
    direct_io: bool
    direct_writes: int
    buffered_writes: int
    direct_reads: int
    buffered_reads: int
    #: write buffers written (one pwritev each, many records)
    batches_written: int = 0
    #: bytes those batches span on disk: values, heads and padding (the header overhead
    #: is ``1 - bytes_written / disk_bytes_written``)
    disk_bytes_written: int = 0
