"""The disk store's settings: frozen, typed, checked at construction (fail closed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ems.disk.records import ALIGN, MAX_BATCH_BYTES

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
    #: the most bytes one read's pread moves (a read checks its deadline between them)
    chunk_bytes: int = 1 << 20
    #: the most bytes of values one write buffer packs into one batch, one pwritev (a
    #: larger value goes alone). 8 MiB: 512 records of 16 KiB per I/O, their heads and
    #: padding about 0.6 % of the bytes written; a region of 64 MiB ends at most one
    #: buffer short. Each batch costs a writer its own steps (a reservation, a head, a
    #: lock, its wake-ups for the interpreter lock around the checksums and the
    #: ``pwritev``): measured on the 2-vCPU VM, ``ems-server --disk`` spilling 1 GiB
    #: through 256 MiB, three alternating runs of each: 16 KiB values 68-70 thousand a
    #: second with buffers of 4 MiB, 61-72 with 6 MiB, 71-75 with 8 MiB (the daemon's
    #: CPU 13.4-14.2 -> 12.4-13.0 us a value) and 66-70 with 16 MiB (a save of 32 MiB
    #: is then two writes); 1 MiB values 1.53-1.80 -> 1.64-1.91 GB/s (five runs), 256
    #: KiB values 1.73-1.75 -> 1.89-1.91 (two runs); the device's own writes of 4 and
    #: 8 MiB alike (1.6-2.0 GB/s)
    write_buffer_bytes: int = 8 << 20
    #: test hook: every pread/pwrite of the I/O layer sleeps this long first
    io_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("DiskSettings.path must be a non-empty path")
        if self.region_bytes <= ALIGN or self.region_bytes % ALIGN:
            raise ValueError(f"region_bytes must be a multiple of {ALIGN} above {ALIGN}")
        if self.capacity_bytes < self.region_bytes:
            raise ValueError("capacity_bytes must hold at least one region")
        if self.checkpoint_s < 0:
            raise ValueError("checkpoint_s must be >= 0")
        if self.write_budget_bytes_per_day is not None and self.write_budget_bytes_per_day <= 0:
            raise ValueError("write_budget_bytes_per_day must be positive or None")
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
        if not ALIGN <= self.write_buffer_bytes < MAX_BATCH_BYTES:
            raise ValueError(f"write_buffer_bytes must be at least {ALIGN} and below "
                             f"{MAX_BATCH_BYTES}")
        if self.io_delay_s < 0:
            raise ValueError("io_delay_s must be >= 0")
