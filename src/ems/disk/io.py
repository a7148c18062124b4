"""The disk store's only file I/O: a :class:`FileSystem` (the system calls the store
makes, one method each) and :class:`RegionFile`, one region file read and written in
chunks with ``preadv``/``pwritev``, through ``O_DIRECT`` where the memory and the file
allow.

The store takes its file system by injection (:class:`LocalFileSystem` by default), so a
test can put a recording layer underneath that knows, per fsync(2), what a power cut at
any instant would leave (``ems.testing.powercut``): every name the store creates,
renames or removes and every byte it writes crosses this seam, and nothing else touches
the directory.

Every ``preadv``/``pwritev`` of a region goes through :meth:`RegionFile._io`, so the
test hook ``io_delay_s`` (each call sleeps that long first) lives in exactly one place.

Why ``O_DIRECT``: a spill of KV blocks is written once and read back maybe never; through
the page cache it would evict the host's useful pages and cost a copy. A transfer at a
file offset and of pieces whose lengths are multiples of :data:`~ems.disk.records.ALIGN`
tries it (the daemon's arena is page aligned, objects are 64-byte aligned and usually 4
KiB multiples); the kernel refuses memory the device cannot take directly with
``EINVAL`` before it moves a byte, and that transfer goes on buffered. (Asking the
kernel replaced an address check per buffer in Python, a ctypes object each: ~0.6 us of
every 16 KiB value spilled, with the GIL held, on the 2-vCPU VM.) Any other offset, and
a filesystem that refuses ``O_DIRECT`` at open (``EINVAL``: tmpfs before Linux 6.6,
some FUSE), go buffered.
Both descriptors of a file stay coherent: the kernel writes back and invalidates the
page cache over the range of a direct transfer.

Why reads in chunks of at most ``chunk_bytes``: a read checks its deadline between
chunks, so a slow disk costs a caller at most one chunk's time past its deadline, and no
byte lands in the caller's buffer from a transfer started after it. A write (one write
buffer's batch, gathered from the values where they are: no copy) is one ``pwritev``
of up to :data:`IOV_MAX` pieces, split only past that or :data:`WRITE_CHUNK_BYTES`.
"""

from __future__ import annotations

import errno
import fcntl
import math
import operator
import os
import time
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Optional, Protocol, Sequence

from ems.disk.records import ALIGN

__all__ = ["IOV_MAX", "LOCAL", "WRITE_CHUNK_BYTES", "DirEntry", "FileSystem",
           "LocalFileSystem", "RegionFile", "probe_direct", "read_file",
           "replace_file"]

#: the most buffers one preadv/pwritev takes (Linux's UIO_MAXIOV)
IOV_MAX = 1024
#: the most bytes one pwritev of a batch moves
WRITE_CHUNK_BYTES = 64 << 20

Clock = Callable[[], float]


@dataclass(frozen=True)
class DirEntry:
    """One name in a directory (symbolic links are neither files nor directories)."""

    name: str
    is_dir: bool
    is_file: bool
    size: int


class FileSystem(Protocol):
    """The file operations of the disk store, one per system call it makes. Paths are
    absolute; a descriptor is the ``int`` :meth:`open_file` returned. Errors are
    ``OSError`` with the system's errno, as ``os`` raises them.

    Durability is fsync(2)'s and nothing more: a file's bytes are durable after
    :meth:`sync_data` (fdatasync) or :meth:`sync_file` (fsync) of it; a name that
    :meth:`open_file` created, :meth:`make_dir` made, :meth:`rename` moved or
    :meth:`unlink` removed is durable only after :meth:`sync_dir` of its directory."""

    def open_file(self, path: str, *, create: bool = False, exclusive: bool = False,
                  truncate: bool = False, direct: bool = False) -> int:
        """open(2) read-write, close-on-exec, mode 0600 when created; ``direct``:
        ``O_DIRECT`` (``EINVAL`` where the file system refuses it)."""
        ...

    def close(self, fd: int) -> None: ...

    def write_at(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        """pwritev(2): bytes written (possibly fewer than asked)."""
        ...

    def read_at(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        """preadv(2): bytes read (fewer at the end of the file)."""
        ...

    def read_bytes(self, fd: int, n: int, offset: int) -> bytes:
        """pread(2): up to ``n`` bytes (fewer at the end of the file)."""
        ...

    def file_size(self, fd: int) -> int: ...

    def sync_data(self, fd: int) -> None:
        """fdatasync(2)."""
        ...

    def sync_file(self, fd: int) -> None:
        """fsync(2)."""
        ...

    def make_dir(self, path: str) -> bool:
        """mkdir(2) with mode 0700: True when made, False when it was already there."""
        ...

    def make_private(self, path: str) -> None:
        """chmod(2) to 0700."""
        ...

    def sync_dir(self, path: str) -> None:
        """fsync(2) of the directory: its names so far are durable."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """rename(2), replacing ``dst``."""
        ...

    def unlink(self, path: str) -> None: ...

    def exists(self, path: str) -> bool: ...

    def dir_id(self, path: str) -> int:
        """The inode number of ``path`` (a replaced directory has another)."""
        ...

    def list_dir(self, path: str) -> list[DirEntry]: ...

    def total_bytes(self, path: str) -> int:
        """The size of the file system holding ``path`` (statvfs(3))."""
        ...

    def lock(self, path: str) -> int:
        """Create ``path`` if needed, open it and take an exclusive ``flock`` without
        waiting (``BlockingIOError`` when another holder has it); the descriptor holds
        the lock until :meth:`close`."""
        ...


class LocalFileSystem:
    """:class:`FileSystem` on the host's files: each method is its ``os`` call."""

    def open_file(self, path: str, *, create: bool = False, exclusive: bool = False,
                  truncate: bool = False, direct: bool = False) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT | (os.O_EXCL if exclusive else 0)
        if truncate:
            flags |= os.O_TRUNC
        if direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o600)

    def close(self, fd: int) -> None:
        os.close(fd)

    def write_at(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, views, offset)

    def read_at(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, views, offset)

    def read_bytes(self, fd: int, n: int, offset: int) -> bytes:
        return os.pread(fd, n, offset)

    def file_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def sync_data(self, fd: int) -> None:
        os.fdatasync(fd)

    def sync_file(self, fd: int) -> None:
        os.fsync(fd)

    def make_dir(self, path: str) -> bool:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return False
        return True

    def make_private(self, path: str) -> None:
        os.chmod(path, 0o700)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def dir_id(self, path: str) -> int:
        return os.stat(path).st_ino

    def list_dir(self, path: str) -> list[DirEntry]:
        out = []
        with os.scandir(path) as it:
            for e in it:
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                    is_file = e.is_file(follow_symlinks=False)
                    size = e.stat(follow_symlinks=False).st_size if is_file else 0
                except OSError:  # removed while listed
                    continue
                out.append(DirEntry(e.name, is_dir, is_file, size))
        return out

    def total_bytes(self, path: str) -> int:
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize

    def lock(self, path: str) -> int:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return fd


#: the host's file system, the store's default
LOCAL: FileSystem = LocalFileSystem()


def read_file(fs: FileSystem, path: str) -> bytes:
    """The whole file at ``path`` (``FileNotFoundError`` when there is none)."""
    fd = fs.open_file(path)
    try:
        return fs.read_bytes(fd, fs.file_size(fd), 0)
    finally:
        fs.close(fd)


def replace_file(fs: FileSystem, path: str, data: bytes) -> None:
    """``path`` holds ``data``, durably, name included: written to ``path.tmp`` and
    fsynced, renamed over ``path``, its directory fsynced. A power cut at any instant
    leaves the old file or the new one, never a mix. Raises OSError."""
    tmp = path + ".tmp"
    fd = fs.open_file(tmp, create=True, truncate=True)
    try:
        view = memoryview(data)
        at = 0
        while at < len(data):
            at += fs.write_at(fd, [view[at:]], at)
        fs.sync_file(fd)
    finally:
        fs.close(fd)
    fs.rename(tmp, path)
    fs.sync_dir(os.path.dirname(path) or ".")


def probe_direct(fs: FileSystem, directory: str) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT``."""
    if not getattr(os, "O_DIRECT", 0):
        return False
    path = os.path.join(directory, ".direct-probe")
    try:
        fd = fs.open_file(path, create=True, direct=True)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    fs.close(fd)
    fs.unlink(path)
    return True


_NBYTES = operator.attrgetter("nbytes")
_FORMAT = operator.attrgetter("format")
_BYTES = {"B"}


class RegionFile:
    """One region file, shared by reading and writing threads; reference counted by the
    store so an evicted region's descriptors close only when its last reader is done
    (closing earlier could let a reader hit a reused descriptor number)."""

    def __init__(self, fs: FileSystem, path: str, *, create: bool, direct: bool,
                 chunk_bytes: int, io_delay_s: float = 0.0) -> None:
        self.fs = fs
        self.path = path
        self.fd = fs.open_file(path, create=create, exclusive=create)
        self.direct_fd = -1
        if direct:
            try:
                self.direct_fd = fs.open_file(path, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    fs.close(self.fd)
                    raise
        self.chunk_bytes = chunk_bytes
        self.io_delay_s = io_delay_s
        self.users = 0
        self.dead = False

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                self.fs.close(fd)
        self.fd = self.direct_fd = -1

    def size(self) -> int:
        return self.fs.file_size(self.fd)

    def fdatasync(self) -> None:
        self.fs.sync_data(self.fd)

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
        """Move ``views`` in system calls of at most ``limit`` bytes and :data:`IOV_MAX`
        pieces, cut by bisection on the pieces' running ends (a loop of Python per piece
        cost ~0.8 us of every 16 KiB value spilled, as much as its checksum's overhead);
        a short transfer goes on from the byte where it stopped."""
        lens = list(map(_NBYTES, views))
        pending = list(views)
        if 0 in lens or set(map(_FORMAT, pending)) != _BYTES:  # (rare) empty, not bytes
            pending = [v.cast("B") if v.format != "B" else v for v in views if v.nbytes]
            lens = list(map(_NBYTES, pending))
        # (every length a multiple of ALIGN: their gcd is one, found at C speed)
        direct = (self.direct_fd >= 0 and not offset % ALIGN
                  and not math.gcd(*lens) % ALIGN)
        fd = self.direct_fd if direct else self.fd
        limit = WRITE_CHUNK_BYTES if write else self.chunk_bytes
        ends = list(accumulate(lens))  # where each piece ends, from the first byte
        count, total = len(ends), ends[-1] if ends else 0
        i = moved = skip = 0  # the first piece not moved yet; bytes moved; of piece i
        while moved < total:
            if deadline is not None and clock() >= deadline:
                raise TimeoutError
            top = min(count, i + IOV_MAX)
            j = bisect_right(ends, moved + limit, i, top)  # pieces i..j-1 fit whole
            chunk = pending[i:j]
            if skip and chunk:
                chunk[0] = chunk[0][skip:]
            want = ends[j - 1] - moved if j > i else 0
            if j < top and want < limit:  # a part of piece j fills the call
                start = skip if j == i else 0
                chunk.append(pending[j][start:start + limit - want])
                want = limit
            try:
                done = self._io(fd, chunk, offset + moved, write)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                direct, fd = False, self.fd  # memory O_DIRECT refuses
                done = self._io(fd, chunk, offset + moved, write)
            if done <= 0:
                raise EOFError(f"{self.path}: {'write' if write else 'read'} returned {done}")
            moved += min(done, want)
            i = bisect_right(ends, moved, i)
            skip = moved - (ends[i - 1] if i else 0)
        return direct

    def _io(self, fd: int, chunk: list[memoryview], offset: int, write: bool) -> int:
        if self.io_delay_s:
            time.sleep(self.io_delay_s)
        if write:
            return self.fs.write_at(fd, chunk, offset)
        return self.fs.read_at(fd, chunk, offset)
