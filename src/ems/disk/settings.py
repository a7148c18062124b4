"""The disk store's settings: frozen, typed, checked at construction (fail closed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ems.disk.records import ALIGN, HEADER_BYTES

__all__ = ["DiskSettings"]


@dataclass(frozen=True)
class DiskSettings:
    """Where and how the disk store keeps its records."""

    #: the store's directory (created 0700; one store per directory)
    path: str
    #: bytes of region files over all tenants (may exceed the filesystem: ENOSPC then
    #: stops admission at what fits)
    capacity_bytes: int
    #: seconds between checkpoints of the index (what a crash can lose is at most the
    #: objects written since the last one); 0 disables the timer
    checkpoint_s: float = 10.0
    #: bytes of one region file, the unit of eviction. 64 MiB: large enough that a
    #: region holds 64 V0 objects of 1 MiB and eviction deletes a few files per GB
    #: written, small enough that an eviction gives up ~0.1 % of a 64 GiB disk
    region_bytes: int = 64 << 20
    #: bytes the store may write per day (SSD wear); None: unbounded
    write_budget_bytes_per_day: Optional[int] = None
    #: the most bytes one pread/pwrite moves (a read checks its deadline between them)
    chunk_bytes: int = 1 << 20
    #: test hook: every pread/pwrite of the I/O layer sleeps this long first
    io_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("DiskSettings.path must be a non-empty path")
        if self.region_bytes <= HEADER_BYTES or self.region_bytes % ALIGN:
            raise ValueError(f"region_bytes must be a multiple of {ALIGN} above {HEADER_BYTES}")
        if self.capacity_bytes < self.region_bytes:
            raise ValueError("capacity_bytes must hold at least one region")
        if self.checkpoint_s < 0:
            raise ValueError("checkpoint_s must be >= 0")
        if self.write_budget_bytes_per_day is not None and self.write_budget_bytes_per_day <= 0:
            raise ValueError("write_budget_bytes_per_day must be positive or None")
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
        if self.io_delay_s < 0:
            raise ValueError("io_delay_s must be >= 0")
