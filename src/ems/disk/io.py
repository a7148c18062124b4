"""The disk store's only file I/O: one region file, read and written in chunks with
``os.preadv``/``os.pwritev``, through ``O_DIRECT`` where the memory and the file allow.

Every ``preadv``/``pwritev`` of the store goes through :meth:`RegionFile._io`, so the
test hook ``io_delay_s`` (each call sleeps that long first) lives in exactly one place.

Why ``O_DIRECT``: a spill of KV blocks is written once and read back maybe never; through
the page cache it would evict the host's useful pages and cost a copy. It is used when
every buffer address, every length and the file offset are multiples of
:data:`~ems.disk.records.ALIGN` (the daemon's arena is page aligned, objects are 64-byte
aligned and usually 4 KiB multiples); anything else, and a filesystem that refuses
``O_DIRECT`` at open (``EINVAL``: tmpfs before Linux 6.6, some FUSE), goes buffered.
Both descriptors of a file stay coherent: the kernel writes back and invalidates the
page cache over the range of a direct transfer.

Why chunks of at most ``chunk_bytes`` (of the value; the header block rides along with
the first): a read checks its deadline between chunks, so a
slow disk costs a caller at most one chunk's time past its deadline, and no byte lands
in the caller's buffer from a transfer started after it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from typing import Callable, Optional, Sequence

from ems.disk.records import ALIGN

__all__ = ["RegionFile", "address_of", "probe_direct"]

Clock = Callable[[], float]


def address_of(view: memoryview) -> Optional[int]:
    """The address of ``view``'s first byte, or None when it is read-only (no O_DIRECT
    then: a ``bytes`` value is copied through the page cache)."""
    if view.readonly or not view.contiguous:
        return None
    if view.nbytes == 0:
        return 0
    c = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _aligned(views: Sequence[memoryview], offset: int) -> bool:
    if offset % ALIGN:
        return False
    for v in views:
        if v.nbytes % ALIGN:
            return False
        a = address_of(v)
        if a is None or a % ALIGN:
            return False
    return True


def probe_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | flag, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(path)
    return True


class RegionFile:
    """One region file, shared by reading and writing threads; reference counted by the
    store so an evicted region's descriptors close only when its last reader is done
    (closing earlier could let a reader hit a reused descriptor number)."""

    def __init__(self, path: str, *, create: bool, direct: bool, chunk_bytes: int,
                 io_delay_s: float = 0.0) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0) | os.O_CLOEXEC
        self.path = path
        self.fd = os.open(path, flags, 0o600)
        self.direct_fd = -1
        if direct:
            try:
                self.direct_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    os.close(self.fd)
                    raise
        self.chunk_bytes = chunk_bytes
        self.io_delay_s = io_delay_s
        self.users = 0
        self.dead = False

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def fdatasync(self) -> None:
        os.fdatasync(self.fd)

    def write(self, views: Sequence[memoryview], offset: int) -> bool:
        """Write ``views`` back to back at ``offset``; True when it went O_DIRECT."""
        return self._transfer(views, offset, write=True, deadline=None, clock=time.monotonic)

    def read(self, views: Sequence[memoryview], offset: int, deadline: Optional[float],
             clock: Clock) -> Optional[bool]:
        """Fill ``views`` from ``offset``: True/False whether it went O_DIRECT, None when
        ``deadline`` (by ``clock``) passed before the transfer was done. A short read
        (the file ends early) raises ``EOFError``."""
        try:
            return self._transfer(views, offset, write=False, deadline=deadline, clock=clock)
        except TimeoutError:
            return None

    def _transfer(self, views: Sequence[memoryview], offset: int, *, write: bool,
                  deadline: Optional[float], clock: Clock) -> bool:
        direct = self.direct_fd >= 0 and _aligned(views, offset)
        fd = self.direct_fd if direct else self.fd
        pending = [v.cast("B") if v.format != "B" else v for v in views if v.nbytes]
        first = True
        while pending:
            if deadline is not None and clock() >= deadline:
                raise TimeoutError
            chunk: list[memoryview] = []
            # the header block rides with the first chunk of the value: a 1 MiB value is
            # one call, not a 1 MiB call and a 4 KiB one (which cost a V0 write or read
            # a second I/O's latency)
            room = self.chunk_bytes + (pending[0].nbytes if first and len(pending) > 1
                                       and pending[0].nbytes <= ALIGN else 0)
            first = False
            while pending and room:
                v = pending[0]
                take = min(room, v.nbytes)
                chunk.append(v[:take])
                room -= take
                if take == v.nbytes:
                    pending.pop(0)
                else:
                    pending[0] = v[take:]
            done = self._io(fd, chunk, offset, write)
            want = sum(c.nbytes for c in chunk)
            if done <= 0:
                raise EOFError(f"{self.path}: {'write' if write else 'read'} returned {done}")
            offset += done
            if done < want:  # short transfer: put the rest back in front
                rest = []
                skip = done
                for c in chunk:
                    if skip >= c.nbytes:
                        skip -= c.nbytes
                        continue
                    rest.append(c[skip:])
                    skip = 0
                pending[:0] = rest
        return direct

    def _io(self, fd: int, chunk: list[memoryview], offset: int, write: bool) -> int:
        if self.io_delay_s:
            time.sleep(self.io_delay_s)
        if write:
            return os.pwritev(fd, chunk, offset)
        return os.preadv(fd, chunk, offset)
