"""The disk store on real files: bit-exact round trips through O_DIRECT and buffered
I/O, restarts clean and after ``kill -9``, damaged and truncated files, a full
filesystem, a vanished directory, a slow disk against a deadline, tenants, quotas."""

from __future__ import annotations

import logging
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.disk import (
    DiskSettings,
    DiskState,
    DiskStore,
    DiskStoreLocked,
    ReadResult,
    WriteResult,
)
from ems.disk.io import LocalFileSystem
from ems.disk.store import GROUP_DEPTH

SRC = str(Path(__file__).resolve().parents[2] / "src")
MiB = 1 << 20
KiB = 1 << 10


def value_of(key: str, n: int) -> bytes:
    return random.Random(f"{key}/{n}").randbytes(n)


def opened(path, **kw) -> DiskStore:
    kw.setdefault("capacity_bytes", 256 * MiB)
    kw.setdefault("region_bytes", 4 * MiB)
    store = DiskStore(DiskSettings(str(path), **kw))
    store.open()
    assert store.wait_recovered(30)
    assert store.state is DiskState.OK
    return store


def read_back(store: DiskStore, tenant: str, key: str, n: int, offset: int = 0):
    buf = mmap.mmap(-1, n + offset)
    view = memoryview(buf)[offset:offset + n]
    got = store.read(tenant, key, view, time.monotonic() + 30)
    data = bytes(view)
    view.release()
    buf.close()
    return got, data


@pytest.fixture(params=["disk", "shm"])
def where(request, tmp_path):
    if request.param == "disk":
        yield tmp_path / "store"
        return
    base = tempfile.mkdtemp(dir="/dev/shm")
    try:
        yield Path(base) / "store"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("size", [MiB, 16 * KiB])
@pytest.mark.parametrize("shift", [0, 1])
def test_write_read_bit_exact(where, size, shift):
    store = opened(where)
    try:
        buf = mmap.mmap(-1, size + 4096)
        buf[shift:shift + size] = value_of("k", size)
        view = memoryview(buf)[shift:shift + size]
        assert store.write("t", "k", view) is WriteResult.WRITTEN
        assert store.write("t", "k", view) is WriteResult.EXISTS
        view.release()
        buf.close()
        assert store.contains("t", "k", size) and not store.contains("t", "k", size + 1)
        assert store.read("t", "nope", memoryview(bytearray(1)), time.monotonic() + 5) \
            is ReadResult.MISS
        got, data = read_back(store, "t", "k", size, offset=shift)
        assert got is ReadResult.HIT and data == value_of("k", size)
        st = store.statistics()
        # Memory 1 byte off: the kernel refuses O_DIRECT (EINVAL) and the transfer goes
        # buffered; tmpfs takes any memory directly.
        if shift == 0 or not str(where).startswith("/dev/shm"):
            aligned = shift == 0 and st.direct_io
            assert (st.direct_writes, st.buffered_writes) == ((1, 0) if aligned else (0, 1))
            assert (st.direct_reads, st.buffered_reads) == ((1, 0) if aligned else (0, 1))
        assert st.direct_writes + st.buffered_writes == st.direct_reads + st.buffered_reads == 1
        assert (st.hits, st.misses, st.objects) == (1, 1, 1)
        mode = os.stat(where).st_mode & 0o777
        files = [p for p in where.rglob("*") if p.is_file()]
        assert mode == 0o700 and files
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in files)
    finally:
        store.close()


def test_clean_restart_finds_everything_without_a_scan(tmp_path):
    store = opened(tmp_path, checkpoint_s=0)
    keys = {f"k{i}": (i % 7 + 1) * 4096 + i for i in range(60)}
    for k, n in keys.items():
        assert store.write("t", k, value_of(k, n)) is WriteResult.WRITTEN
    store.close()
    store = opened(tmp_path, checkpoint_s=0)
    try:
        st = store.statistics()
        assert st.scan_skipped and st.records_scanned == 0 and st.records_recovered == 60
        for k, n in keys.items():
            assert read_back(store, "t", k, n) == (ReadResult.HIT, value_of(k, n))
    finally:
        store.close(clean=False)
    store = opened(tmp_path, checkpoint_s=0)  # no marker: the scan runs, finds nothing new
    try:
        assert not store.scan_skipped and store.statistics().records_recovered == 60
    finally:
        store.close()


def test_a_store_abandoned_without_close_recovers_by_scan(tmp_path):
    store = opened(tmp_path, checkpoint_s=0)
    for i in range(10):
        assert store.write("t", f"a{i}", value_of(f"a{i}", 5000)) is WriteResult.WRITTEN
    store.checkpoint()
    for i in range(10):
        assert store.write("t", f"b{i}", value_of(f"b{i}", 5000)) is WriteResult.WRITTEN
    # a crash: the file lock goes with the descriptor, nothing else is written
    os.close(store._lock_fd)
    store._lock_fd = -1
    store._state = DiskState.OFF
    again = opened(tmp_path, checkpoint_s=0)
    try:
        st = again.statistics()
        assert not st.scan_skipped and st.records_scanned >= 10
        for k in [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)]:
            assert read_back(again, "t", k, 5000) == (ReadResult.HIT, value_of(k, 5000))
    finally:
        again.close()
        store.close()


CHILD = textwrap.dedent("""
    import mmap, random, sys, time
    from ems.disk import DiskSettings, DiskStore, WriteResult
    path, start = sys.argv[1], int(sys.argv[2])
    # 4 GiB: no region is evicted within the test (a quiet host writes ~1 GiB in 6 rounds;
    # 512 MiB filled by round 4 and evicted checkpointed keys, which the test counts as lost)
    store = DiskStore(DiskSettings(path, 4 << 30, region_bytes=1 << 20, checkpoint_s=0.05))
    store.open()
    store.wait_recovered(60)
    buf = mmap.mmap(-1, 64 << 10)
    view = memoryview(buf)
    i = start
    while True:
        key = f"k{i}"
        n = (4 << 10) * (1 + i % 16)
        buf[:n] = random.Random(f"{key}/{n}").randbytes(n)
        assert store.write("t", key, view[:n]) in (WriteResult.WRITTEN, WriteResult.EXISTS)
        i += 1
        if i % 25 == 0:
            store.checkpoint()
            print("checkpointed", i, flush=True)
""")


@pytest.mark.slow
def test_kill_9_loop_never_serves_wrong_bytes(tmp_path):
    rng = random.Random(5)
    start = 0
    found_total = 0
    must = set()  # keys checkpointed in some round: found after every restart
    for _round in range(6):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(start)],
                                 stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": SRC})
        try:
            lines = []
            deadline = time.monotonic() + rng.uniform(0.8, 2.0)
            while time.monotonic() < deadline:
                line = child.stdout.readline()  # the child prints every 25 writes
                if not line:
                    break
                lines.append(line)
            child.kill()  # SIGKILL, at whatever it was doing
            child.wait(30)
            rest = child.stdout.read()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
        lines += rest.splitlines()
        done = [int(x.split()[1]) for x in lines if x.startswith("checkpointed")]
        assert done, "the child wrote nothing before it was killed"
        checkpointed = max(done)
        must |= set(range(start, checkpointed))
        store = opened(tmp_path, capacity_bytes=4096 * MiB, region_bytes=MiB, checkpoint_s=0)
        try:
            hits = 0
            for i in range(checkpointed + 200):
                key = f"k{i}"
                n = (4 << 10) * (1 + i % 16)
                got, data = read_back(store, "t", key, n) if store.contains("t", key) \
                    else (ReadResult.MISS, b"")
                if got is ReadResult.HIT:
                    assert data == value_of(key, n), key  # never a wrong byte
                    hits += 1
                else:
                    assert i not in must, f"{key} was checkpointed and is lost ({got})"
            found_total = hits
            start = checkpointed + 200
        finally:
            store.close(clean=False)
    assert found_total > 0


def _region_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.region"))


@pytest.mark.parametrize("clean", [True, False], ids=["checkpoint", "scan"])
def test_damaged_and_truncated_records_are_misses(tmp_path, clean):
    store = opened(tmp_path, checkpoint_s=0, region_bytes=256 * KiB)
    keys = [f"k{i}" for i in range(40)]
    for k in keys:
        assert store.write("t", k, value_of(k, 16 * KiB)) is WriteResult.WRITTEN
    store.close(clean=clean)
    files = _region_files(tmp_path)
    assert len(files) >= 3
    rng = random.Random(11)
    for f in files[:-1]:
        with open(f, "r+b") as fh:
            size = os.fstat(fh.fileno()).st_size
            for _ in range(4):
                at = rng.randrange(size)
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0x5A]))
    os.truncate(files[-1], os.path.getsize(files[-1]) // 2)
    if not clean:  # a damaged checkpoint too: recovery ignores it and scans every record
        raw = bytearray((tmp_path / "index.ckpt").read_bytes())
        raw[len(raw) // 2] ^= 1
        (tmp_path / "index.ckpt").write_bytes(bytes(raw))
    store = opened(tmp_path, checkpoint_s=0, region_bytes=256 * KiB)
    try:
        results = {}
        for k in keys:
            if store.contains("t", k):
                got, data = read_back(store, "t", k, 16 * KiB)
                assert got in (ReadResult.HIT, ReadResult.DAMAGED), got
                if got is ReadResult.HIT:
                    assert data == value_of(k, 16 * KiB)
                results[k] = got
            else:
                results[k] = ReadResult.MISS
        bad = [k for k, r in results.items() if r is not ReadResult.HIT]
        assert len(bad) >= 4  # a truncated half region and damaged records
        assert sum(r is ReadResult.HIT for r in results.values()) >= 10
        st = store.statistics()
        if clean:  # no scan: every damaged record was found by a read
            assert st.records_dropped_damaged == st.read_damaged >= 4
        else:  # the scan dropped those whose value fails its checksum (a damaged
            # header is garbage to a scan: not counted, and not found)
            assert st.records_dropped_damaged > st.read_damaged == 0
            assert st.records_scanned >= 10 and not st.scan_skipped
        for k in bad:  # dropped: a second read is a plain miss
            assert not store.contains("t", k)
    finally:
        store.close()


def test_a_full_filesystem_is_no_space_and_one_warning(tmp_path, caplog):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        caplog.set_level(logging.WARNING, logger="ems.disk")
        store = opened(mnt / "store", capacity_bytes=64 * MiB, region_bytes=MiB,
                       checkpoint_s=0)
        try:
            results = []
            written = []
            for i in range(60):
                got = store.write("t", f"k{i}", value_of(f"k{i}", 256 * KiB))
                results.append(got)
                if got is WriteResult.WRITTEN:
                    written.append(f"k{i}")
            assert WriteResult.NO_SPACE in results and written
            st = store.statistics()
            assert st.refused_no_space >= 1 and st.state == "ok"
            full = [r for r in caplog.records if "is full (ENOSPC)" in r.getMessage()]
            assert len(full) == 1  # one warning however many writes it refuses
            assert any("larger than the filesystem" in r.getMessage() for r in caplog.records)
            present = [k for k in written if store.contains("t", k)]
            assert present
            for k in present:
                assert read_back(store, "t", k, 256 * KiB) == (ReadResult.HIT,
                                                              value_of(k, 256 * KiB))
        finally:
            store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_removed_directory_turns_the_store_off(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="ems.disk")
    store = opened(tmp_path / "s", checkpoint_s=0)
    try:
        assert store.write("t", "k", b"x" * 5000) is WriteResult.WRITTEN
        shutil.rmtree(tmp_path / "s")
        assert store.write("t", "k2", b"y" * 5000) is WriteResult.OFF
        assert store.read("t", "k", memoryview(bytearray(5000)), time.monotonic() + 5) \
            is ReadResult.OFF
        assert not store.contains("t", "k") and store.leading("t", ["k"], None) == []
        store.checkpoint()
        assert store.write("t", "k3", b"z" * 5000) is WriteResult.OFF
        assert store.state is DiskState.OFF and store.statistics().state == "off"
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    finally:
        store.close()


def test_a_slow_disk_returns_by_the_deadline(tmp_path):
    store = opened(tmp_path, checkpoint_s=0, chunk_bytes=64 * KiB, io_delay_s=0.05)
    try:
        assert store.write("t", "k", value_of("k", MiB)) is WriteResult.WRITTEN  # ~0.85 s
        buf = bytearray(MiB)
        t0 = time.monotonic()
        got = store.read("t", "k", memoryview(buf), t0 + 0.2)
        took = time.monotonic() - t0
        assert got is ReadResult.TIMEOUT
        assert 0.2 <= took < 0.2 + 0.05 + 0.15  # the deadline plus at most one chunk
        assert store.statistics().read_timeouts == 1
        assert store.read("t", "k", memoryview(buf), time.monotonic() + 30) is ReadResult.HIT
        assert bytes(buf) == value_of("k", MiB)
    finally:
        store.close()


def test_tenants_are_isolated_across_a_restart(tmp_path):
    store = opened(tmp_path, checkpoint_s=0)
    assert store.write("a", "k", value_of("a", 8192)) is WriteResult.WRITTEN
    assert store.write("b", "k", value_of("b", 8192)) is WriteResult.WRITTEN
    store.close(clean=False)
    store = opened(tmp_path, checkpoint_s=0)
    try:
        assert read_back(store, "a", "k", 8192) == (ReadResult.HIT, value_of("a", 8192))
        assert read_back(store, "b", "k", 8192) == (ReadResult.HIT, value_of("b", 8192))
        assert store.read("c", "k", memoryview(bytearray(8192)), time.monotonic() + 5) \
            is ReadResult.MISS
        assert {p.name for p in tmp_path.iterdir() if p.is_dir()} == {"t61", "t62"}
    finally:
        store.close()


def test_a_second_store_on_the_same_directory_fails(tmp_path):
    store = opened(tmp_path)
    try:
        with pytest.raises(DiskStoreLocked, match="already open"):
            DiskStore(DiskSettings(str(tmp_path), 256 * MiB, region_bytes=4 * MiB)).open()
    finally:
        store.close()


def test_quota_evicts_the_tenants_least_recently_used_region(tmp_path):
    region = 128 * KiB  # 6 records of 16 KiB (+ a 4 KiB header) per region
    store = opened(tmp_path, checkpoint_s=0, capacity_bytes=64 * region, region_bytes=region)
    try:
        store.set_quota("a", 2 * region)
        for i in range(40):
            assert store.write("a", f"k{i}", value_of(f"k{i}", 16 * KiB)) is WriteResult.WRITTEN
            assert store.write("b", f"k{i}", value_of(f"k{i}", 16 * KiB)) is WriteResult.WRITTEN
        rows = {t.tenant: t for t in store.statistics().tenants}
        assert rows["a"].disk_bytes <= 2 * region and rows["a"].quota_bytes == 2 * region
        assert rows["b"].objects == 40
        assert not store.contains("a", "k0") and store.contains("a", "k39")
        assert store.leading("a", ["k39", "k38", "k0"], None) == [16 * KiB] * 2
        assert len(list((tmp_path / "t61").iterdir())) <= 2
        got = store.write("a", "big", value_of("big", 3 * region))
        assert got is WriteResult.TOO_LARGE
    finally:
        store.close()


def test_on_removed_names_the_keys_that_left_the_index(tmp_path):
    """KV events' seam: an evicted region's keys (those whose record lived there, not
    a key rewritten since into a newer region) and a deleted key, each told once,
    outside the store's lock (the callback reads the store)."""
    region = 128 * KiB  # 6 records of 16 KiB (+ a 4 KiB header) per region
    removed: list[tuple[str, list[str]]] = []
    store = DiskStore(DiskSettings(str(tmp_path), 64 * region, region_bytes=region,
                                   checkpoint_s=0),
                      on_removed=lambda t, keys: removed.append(
                          (t, [k for k in keys if not store.contains(t, k)])))
    store.open()
    assert store.wait_recovered(30)
    try:
        store.set_quota("a", 2 * region)
        for i in range(6):
            assert store.write("a", f"k{i}", value_of(f"k{i}", 16 * KiB)) is WriteResult.WRITTEN
        assert store.write("a", "k0", value_of("k0", 8 * KiB)) is WriteResult.WRITTEN  # newer
        for i in range(6, 13):  # the first region evicted for the last one
            assert store.write("a", f"k{i}", value_of(f"k{i}", 16 * KiB)) is WriteResult.WRITTEN
        assert removed == [("a", ["k1", "k2", "k3", "k4", "k5"])]  # not k0: it moved
        store.delete("a", "k6")
        store.delete("a", "k6")  # gone already: not told again
        assert removed[1:] == [("a", ["k6"])]
    finally:
        store.close()


def test_the_write_budget_refuses_past_its_share(tmp_path):
    clock = [0.0]
    settings = DiskSettings(str(tmp_path), 256 * MiB, region_bytes=4 * MiB, checkpoint_s=0,
                            write_budget_bytes_per_day=24 * 100 * KiB)  # 100 KiB an hour
    store = DiskStore(settings, clock=lambda: clock[0])
    store.open()
    assert store.wait_recovered(30)
    try:
        got = [store.write("t", f"k{i}", value_of("v", 16 * KiB)) for i in range(6)]
        assert got[:4] == [WriteResult.WRITTEN] * 4 and got[5] is WriteResult.BUDGET
        clock[0] += 3600.0  # an hour later: another hour's share
        assert store.write("t", "later", value_of("v", 16 * KiB)) is WriteResult.WRITTEN
        assert store.statistics().refused_budget >= 1
    finally:
        store.close()


def test_reads_during_recovery_wait_within_their_deadline(tmp_path):
    store = opened(tmp_path, checkpoint_s=0)
    for i in range(200):
        store.write("t", f"k{i}", value_of("v", 4096))
    store.close(clean=False)
    store = DiskStore(DiskSettings(str(tmp_path), 256 * MiB, region_bytes=4 * MiB))
    store.open()
    try:
        buf = bytearray(4096)
        # whether recovery is still running or not, the key is found: never a miss
        # only because recovery has not reached it yet
        assert store.read("t", "k199", memoryview(buf), time.monotonic() + 30) is ReadResult.HIT
        assert not store.recovering and store.contains("t", "k0")
    finally:
        store.close()


def test_threads_writing_reading_and_evicting_never_see_wrong_bytes(tmp_path):
    import threading
    region = 256 * KiB
    store = opened(tmp_path, checkpoint_s=0.05, capacity_bytes=8 * region, region_bytes=region)
    errors = []
    counts = {"hits": 0}

    def work(t: int) -> None:
        rng = random.Random(t)
        try:
            # at least 150 operations, and on until a timer checkpoint ran beside them
            # (a fast host finishes 150 in ~40 ms, before the first 50 ms checkpoint)
            for i in range(5000):
                if i >= 150 and store.statistics().checkpoints > 0:
                    break
                k = f"k{rng.randrange(400)}"
                n = 4096 * (1 + int(k[1:]) % 5)
                if rng.random() < 0.5:
                    got = store.write("t", k, value_of(k, n))
                    assert got in (WriteResult.WRITTEN, WriteResult.EXISTS), got
                else:
                    buf = bytearray(n)
                    got = store.read("t", k, memoryview(buf), time.monotonic() + 30)
                    assert got in (ReadResult.HIT, ReadResult.MISS), got
                    if got is ReadResult.HIT:
                        assert bytes(buf) == value_of(k, n), k
                        counts["hits"] += 1
                if rng.random() < 0.05:
                    store.delete("t", k)
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        st = store.statistics()
        assert counts["hits"] > 0 and st.regions_evicted > 0 and st.used_bytes <= 8 * region
        assert st.checkpoints > 0
        store._index.check()
    finally:
        store.close()


class _CountingFS(LocalFileSystem):
    """The host's file system, counting reads (one ``preadv`` each)."""

    def __init__(self) -> None:
        self.reads = 0

    def read_at(self, fd, views, offset):
        self.reads += 1
        return super().read_at(fd, views, offset)


def test_a_batch_of_back_to_back_records_is_read_in_one_transfer(tmp_path):
    """A save's blocks lie back to back in one region file: ``read_batch`` reads them
    with one ``preadv`` (into page-aligned memory: O_DIRECT where the file system has
    it), checks each record alone, and a damaged one is dropped alone; keys in another
    order, missing keys and another region split the runs."""
    fs = _CountingFS()
    store = DiskStore(DiskSettings(str(tmp_path), 256 * MiB, region_bytes=4 * MiB,
                                   checkpoint_s=0), fs=fs)
    store.open()
    assert store.wait_recovered(30)
    size = 64 * KiB
    keys = [f"k{i}" for i in range(8)]
    values = [value_of(k, size) for k in keys]
    assert store.write_batch("t", keys, list(map(memoryview, values))) == \
        [WriteResult.WRITTEN] * 8
    arena = mmap.mmap(-1, 9 * size)
    views = [memoryview(arena)[i * size:(i + 1) * size] for i in range(9)]
    try:
        deadline = time.monotonic() + 30
        fs.reads = 0
        assert store.read_batch("t", list(zip(keys, views)), deadline) == [ReadResult.HIT] * 8
        assert fs.reads == 1  # 512 KiB, one transfer (below the 1 MiB read chunk)
        assert [bytes(v) for v in views[:8]] == values
        fs.reads = 0  # a gap (k3 missing from the batch asked) and a key not stored
        got = store.read_batch("t", [(k, v) for k, v in zip(
            ["k0", "k1", "k2", "k4", "k5", "nope"], views)], deadline)
        assert got == [ReadResult.HIT] * 5 + [ReadResult.MISS] and fs.reads == 2
        # one record damaged on disk: only it is a miss (dropped), its neighbours hit
        region = next(p for p in tmp_path.rglob("*.region"))
        raw = bytearray(region.read_bytes())
        at = raw.find(values[5][:64])
        raw[at + 100] ^= 0xFF
        region.write_bytes(bytes(raw))
        got = store.read_batch("t", list(zip(keys, views)), deadline)
        assert got == [ReadResult.HIT] * 5 + [ReadResult.DAMAGED] + [ReadResult.HIT] * 2
        assert not store.contains("t", "k5") and store.contains("t", "k6")
        st = store.statistics()
        assert st.read_damaged == 1 and st.records_dropped_damaged == 1
    finally:
        for v in views:
            v.release()
        arena.close()
        store.close()


@settings(max_examples=40, deadline=None)
@given(asks=st.lists(st.lists(st.integers(0, 23), max_size=14), min_size=1, max_size=6))
def test_a_batch_read_agrees_with_reads_one_by_one(asks):
    """Whatever keys a batch asks (any order, repeats, keys never stored, runs across
    the saves' batches and regions), each result and each byte is what a read of that
    key alone gives."""
    size = 16 * KiB
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        store = DiskStore(DiskSettings(d, 256 * MiB, region_bytes=256 * KiB,
                                       checkpoint_s=0))
        store.open()
        assert store.wait_recovered(30)
        keys = [f"k{i}" for i in range(20)]  # k20..k23: never stored
        for lo in range(0, 20, 5):  # four saves of five (a region holds ~15)
            store.write_batch("t", keys[lo:lo + 5],
                              [memoryview(value_of(k, size)) for k in keys[lo:lo + 5]])
        arena = mmap.mmap(-1, 15 * size)
        views = [memoryview(arena)[i * size:(i + 1) * size] for i in range(15)]
        try:
            for ask in asks:
                names = [f"k{i}" for i in ask]
                got = store.read_batch("t", list(zip(names, views)), time.monotonic() + 30)
                for name, result, view in zip(names, got, views):
                    alone, data = read_back(store, "t", name, size)
                    assert result is alone
                    if result is ReadResult.HIT:
                        assert bytes(view) == data == value_of(name, size)
        finally:
            for v in views:
                v.release()
            arena.close()
            store.close()


@settings(max_examples=30, deadline=None)
@given(saves=st.lists(st.lists(st.tuples(
    st.integers(0, 11),  # the key
    st.sampled_from([1, 100, 4 * KiB, 12 * KiB, 16 * KiB, 20 * KiB + 3]),  # its length
    st.sampled_from(["bytes", "bytearray", "view", "u16", "2d"])),  # what carries it
    min_size=1, max_size=10), min_size=1, max_size=4))
def test_a_batch_write_stores_each_key_once_whatever_carries_it(saves):
    """``write_batch``'s columns: values as bytes, bytearrays, views of bytes or of
    other items and shapes (cast to bytes), of whole blocks or not (laid out packed or
    spread), a batch cut into write buffers of 16 KiB; a key repeated in a batch is
    written once (the first, EXISTS after), one already held with that size is EXISTS;
    a key saved again with another length is written anew; every key reads back
    its last value byte for byte."""
    import numpy as np

    def carried(key: str, n: int, how: str):
        data = value_of(key, n)
        if how == "bytes":
            return data
        if how == "bytearray":
            return bytearray(data)
        if how == "view" or n % 2:
            return memoryview(data)
        arr = np.frombuffer(data, dtype=np.uint16)
        return memoryview(arr if how == "u16" else arr.reshape(-1, 1 if n % 4 else 2))

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        store = DiskStore(DiskSettings(d, 256 * MiB, region_bytes=1 * MiB, checkpoint_s=0,
                                       write_buffer_bytes=16 * KiB))
        store.open()
        assert store.wait_recovered(30)
        held: dict[str, int] = {}
        try:
            for save in saves:
                keys = [f"k{k}" for k, _, _ in save]
                got = store.write_batch("t", keys, [carried(key, n, how) for key, (_, n, how)
                                                    in zip(keys, save)])
                seen: set[str] = set()
                for key, (_, n, _), result in zip(keys, save, got):
                    want = (WriteResult.EXISTS if key in seen or held.get(key) == n
                            else WriteResult.WRITTEN)
                    assert result is want, (key, n, result)
                    if key not in seen:  # (a repeat in the batch: the first one's value)
                        seen.add(key)
                        held[key] = n
            for key, n in held.items():
                assert read_back(store, "t", key, n) == (ReadResult.HIT, value_of(key, n))
        finally:
            store.close()


class _GateFS(LocalFileSystem):
    """The host's file system whose first ``held`` writes wait for ``gate`` (a slow
    disk under the first writers), counting writes."""

    def __init__(self, held: int) -> None:
        self.writes = 0
        self.held = held
        self.entered = threading.Semaphore(0)
        self.gate = threading.Event()

    def write_at(self, fd, views, offset):
        self.writes += 1
        if self.writes <= self.held:
            self.entered.release()
            assert self.gate.wait(30)
        return super().write_at(fd, views, offset)


def test_small_saves_that_wait_together_are_written_as_one_batch(tmp_path):
    """Group commit: while GROUP_DEPTH small saves of a tenant are being written, the
    saves that arrive queue, and the first of them writes them all as one batch (one
    head, one write); a key in two of them is written once (EXISTS for the second);
    another tenant's save does not wait for this tenant's queue; a scan finds every
    record."""
    assert GROUP_DEPTH == 2
    fs = _GateFS(held=GROUP_DEPTH)
    store = DiskStore(DiskSettings(str(tmp_path), 256 * MiB, region_bytes=4 * MiB,
                                   checkpoint_s=0), fs=fs)
    store.open()
    assert store.wait_recovered(30)
    size = 5000
    saves = {"A": ["a"], "B": ["b"], "C": ["c"], "D": ["c", "d"], "E": ["e"], "U": ["u"]}
    results: dict[str, list[WriteResult]] = {}

    def save(name: str, tenant: str = "t") -> None:
        results[name] = store.write_batch(tenant, saves[name],
                                          [value_of(k, size) for k in saves[name]])

    threads: list[threading.Thread] = []
    try:
        for name in "AB":  # both held at the disk: the tenant's depth is used up
            threads.append(threading.Thread(target=save, args=(name,)))
            threads[-1].start()
            assert fs.entered.acquire(timeout=30)
        for name in "CDE":
            threads.append(threading.Thread(target=save, args=(name,)))
            threads[-1].start()
            for _ in range(3000):  # bounded: each joins the queue in order
                queue = store._queues.get("t")
                if queue is not None and len(queue.waiting) == len(threads) - 2:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError(f"{name} never queued")
        save("U", "u")  # another tenant: its own queue, written at once
        assert results["U"] == [WriteResult.WRITTEN]
        fs.gate.set()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        assert results == {"A": [WriteResult.WRITTEN], "B": [WriteResult.WRITTEN],
                           "C": [WriteResult.WRITTEN],
                           "D": [WriteResult.EXISTS, WriteResult.WRITTEN],
                           "E": [WriteResult.WRITTEN], "U": [WriteResult.WRITTEN]}
        st = store.statistics()
        assert st.batches_written == 4 and st.writes == 6 and fs.writes == 4
        assert not store._queues
        for k in "abcde":
            assert read_back(store, "t", k, size) == (ReadResult.HIT, value_of(k, size))
    finally:
        fs.gate.set()
        for t in threads:
            t.join(30)
        os.close(store._lock_fd)  # a crash: the restart scans
        store._lock_fd = -1
        store._state = DiskState.OFF
        store.close()
    again = opened(tmp_path, checkpoint_s=0)
    try:
        st = again.statistics()
        assert not st.scan_skipped and st.records_scanned == 6
        for k in "abcde":
            assert read_back(again, "t", k, size) == (ReadResult.HIT, value_of(k, size))
        assert read_back(again, "u", "u", size) == (ReadResult.HIT, value_of("u", size))
    finally:
        again.close()
