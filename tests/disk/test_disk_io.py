"""``RegionFile``'s transfers: any pieces, cut into calls of at most ``chunk_bytes`` and
``IOV_MAX`` pieces, through system calls that move fewer bytes than asked (as a signal
or a full device make them), land byte for byte; ``O_DIRECT`` where the kernel takes the
memory, buffered where it refuses it."""

import mmap
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ems.disk.io as dio
from ems.disk.io import LocalFileSystem, RegionFile, probe_direct
from ems.disk.records import ALIGN


class _ShortFS(LocalFileSystem):
    """The host's file system whose reads and writes move a random share of what they
    are asked (at least a byte), recording each call's piece count and bytes."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.calls: list[tuple[int, int]] = []

    def _cut(self, views):
        want = sum(v.nbytes for v in views)
        self.calls.append((len(views), want))
        n = want if self.rng.random() < 0.5 else self.rng.randint(1, want)
        out, left = [], n
        for v in views:
            if not left:
                break
            out.append(v[:left])
            left -= min(left, v.nbytes)
        return out

    def write_at(self, fd, views, offset):
        return os.pwritev(fd, self._cut(views), offset)

    def read_at(self, fd, views, offset):
        return os.preadv(fd, self._cut(views), offset)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(0, 3000), min_size=1, max_size=40),
       chunk=st.integers(1, 5000), iov=st.integers(1, 6), at=st.integers(0, 5000),
       seed=st.integers(0, 2**32 - 1))
def test_any_pieces_land_byte_for_byte_through_short_calls(tmp_path_factory, lens, chunk,
                                                           iov, at, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dio, "IOV_MAX", iov)
        mp.setattr(dio, "WRITE_CHUNK_BYTES", chunk)
        _transfers(tmp_path_factory, lens, chunk, iov, at, seed)


def _transfers(tmp_path_factory, lens, chunk, iov, at, seed):
    path = str(tmp_path_factory.mktemp("io") / "r")
    fs = _ShortFS(seed)
    f = RegionFile(fs, path, create=True, direct=False, chunk_bytes=chunk)
    try:
        rng = random.Random(seed)
        data = [bytes(rng.getrandbits(8) for _ in range(n)) for n in lens]
        f.write([memoryview(d) for d in data], at)
        for n, w in fs.calls:
            assert 1 <= n <= iov and 1 <= w <= chunk
        whole = b"".join(data)
        with open(path, "rb") as fh:
            fh.seek(at)
            assert fh.read() == whole
        got = [bytearray(n) for n in lens]
        fs.calls.clear()
        assert f.read([memoryview(g) for g in got], at, None, lambda: 0.0) is False
        assert b"".join(got) == whole
        assert all(1 <= n <= iov and 1 <= w <= chunk for n, w in fs.calls)
    finally:
        f.close()


def test_direct_where_the_kernel_takes_the_memory_buffered_where_it_refuses(tmp_path):
    """Aligned memory at an aligned offset goes ``O_DIRECT``; memory one byte off does
    too where the file system takes any memory (tmpfs), and else the kernel's EINVAL
    sends that transfer buffered, byte for byte all the same."""
    fs = LocalFileSystem()
    if not probe_direct(fs, str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    f = RegionFile(fs, str(tmp_path / "r"), create=True, direct=True, chunk_bytes=1 << 20)
    arena = mmap.mmap(-1, 4 * ALIGN)
    try:
        arena[:] = os.urandom(4 * ALIGN)
        view = memoryview(arena)
        assert f.write([view[:2 * ALIGN]], 0) is True
        assert f.write([view[1:ALIGN + 1]], 2 * ALIGN) in (True, False)
        back = mmap.mmap(-1, 4 * ALIGN)
        out = memoryview(back)
        assert f.read([out[:2 * ALIGN]], 0, None, lambda: 0.0) is True
        assert f.read([out[2 * ALIGN + 1:3 * ALIGN + 1]], 2 * ALIGN, None, lambda: 0.0) \
            in (True, False)
        assert bytes(out[:2 * ALIGN]) == bytes(view[:2 * ALIGN])
        assert bytes(out[2 * ALIGN + 1:3 * ALIGN + 1]) == bytes(view[1:ALIGN + 1])
        out.release()
        back.close()
        view.release()
    finally:
        f.close()
        arena.close()
