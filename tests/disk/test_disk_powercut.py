"""Power cuts by the letter of fsync(2): the disk store runs on real files under
``ems.testing.powercut.PowerCutFileSystem``, which journals every write, fsync,
create, rename and unlink; each test then builds what the disk would hold after a cut
at some journal entry (only the durable state, or that plus a random survival of the
rest: writes kept, lost or torn, a prefix of the name changes) into a real directory,
opens a real store there (the real recovery code on the host's files), and asserts:
not one wrong byte, and every key the last completed checkpoint covered is found
(unless its region was evicted, its file removed, before the cut).

The double itself is tested first: a test double that cannot fail proves nothing."""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from ems.disk import DiskSettings, DiskState, DiskStore, ReadResult, WriteResult
from ems.disk.io import LOCAL
from ems.disk.records import decode_checkpoint
from ems.disk.recovery import recover
from ems.testing.powercut import (
    Event,
    Note,
    PowerCutFileSystem,
    Rename,
    SyncDir,
    Unlink,
)

KiB = 1 << 10
REGION = 64 * KiB
CAPACITY = 64 * REGION

Name = tuple[str, str]  # (tenant, key)


# --- the double ----------------------------------------------------------------------

def _write_file(fs: PowerCutFileSystem, path: str, data: bytes, sync: bool) -> int:
    fd = fs.open_file(path, create=True)
    fs.write_at(fd, [memoryview(data)], 0)
    if sync:
        fs.sync_data(fd)
    return fd


def test_the_double_keeps_a_synced_file_only_once_its_directory_is_synced(tmp_path):
    (tmp_path / "base").mkdir()
    base = str(tmp_path / "base")
    fs = PowerCutFileSystem(base)
    assert fs.make_dir(base + "/d")
    fd = _write_file(fs, base + "/d/f", b"durable!", sync=True)
    fs.write_at(fd, [memoryview(b"lost")], 8)  # never synced
    fs.close(fd)
    cut_unsynced_dirs = len(fs.events)
    fs.sync_dir(base + "/d")
    cut_inner_dir = len(fs.events)
    fs.sync_dir(base)
    cut_all = len(fs.events)
    fs.unlink(base + "/d/f")
    cut_unlinked = len(fs.events)

    made = iter(range(1000))

    def image(cut: int, rng: Optional[random.Random] = None) -> Path:
        where = tmp_path / f"image-{next(made)}"
        fs.image(cut, str(where), rng)
        return where

    assert not (image(cut_unsynced_dirs) / "d").exists()  # mkdir never made durable
    assert not (image(cut_inner_dir) / "d").exists()  # d's own name still is not
    assert (image(cut_all) / "d" / "f").read_bytes() == b"durable!"
    assert (image(cut_unlinked) / "d" / "f").read_bytes() == b"durable!"  # unlink not synced
    fs.sync_dir(base + "/d")
    assert not (image(len(fs.events)) / "d" / "f").exists()
    assert fs.contents(cut_all, base + "/d/f") == b"durable!lost"  # what a reader saw
    assert (tmp_path / "base" / "d").is_dir()  # the real files were changed, too
    fates = {(image(cut_all, random.Random(s)) / "d" / "f").read_bytes() for s in range(40)}
    assert b"durable!" in fates and b"durable!lost" in fates  # lost, kept (and torn)


def test_the_double_keeps_a_rename_only_once_its_directory_is_synced(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "ckpt").write_bytes(b"old")  # there at construction: durable
    fs = PowerCutFileSystem(str(base))
    fs.close(_write_file(fs, str(base / "ckpt.tmp"), b"new", sync=True))
    fs.rename(str(base / "ckpt.tmp"), str(base / "ckpt"))
    renamed = len(fs.events)
    fs.sync_dir(str(base))
    fs.image(renamed, str(tmp_path / "a"))
    fs.image(len(fs.events), str(tmp_path / "b"))
    assert (tmp_path / "a" / "ckpt").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path / "a")) == ["ckpt"]
    assert (tmp_path / "b" / "ckpt").read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path / "b")) == ["ckpt"]


def test_the_double_tears_writes_at_sectors(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    fs = PowerCutFileSystem(str(base))
    fd = _write_file(fs, str(base / "f"), b"", sync=True)
    fs.sync_dir(str(base))
    new = bytes(range(256)) * 16  # 4 KiB, eight sectors
    fs.write_at(fd, [memoryview(new)], 0)
    fs.close(fd)
    seen = set()
    for s in range(60):
        where = tmp_path / f"i{s}"
        fs.image(len(fs.events), str(where), random.Random(s))
        got = (where / "f").read_bytes()
        seen.add("kept" if got == new else "lost" if got == b"" else "torn")
        if got not in (new, b""):
            keep = next(i for i in range(0, len(new) + 1, 512)
                        if got[i:i + 512] != new[i:i + 512])
            assert got[:keep] == new[:keep] and keep % 512 == 0
    assert seen == {"kept", "lost", "torn"}


# --- the store under power cuts ------------------------------------------------------

def size_of(key: str) -> int:
    i = int(key.rsplit("-", 1)[1])
    return 4096 * (1 + i % 3) + (i * 37) % 4096


def value_of(tenant: str, key: str) -> bytes:
    return random.Random(f"{tenant}/{key}").randbytes(size_of(key))


def store_on(fs, root: str, **kw) -> DiskStore:
    kw.setdefault("capacity_bytes", CAPACITY)
    kw.setdefault("region_bytes", REGION)
    kw.setdefault("checkpoint_s", 0)
    store = DiskStore(DiskSettings(root, **kw), fs=fs)
    store.open()
    assert store.wait_recovered(30) and store.state is DiskState.OK
    return store


def write(store: DiskStore, fs: PowerCutFileSystem, tenant: str, key: str) -> None:
    assert store.write(tenant, key, value_of(tenant, key)) is WriteResult.WRITTEN
    fs.note(f"written {tenant} {key}")


@dataclass(frozen=True)
class Completed:
    """A checkpoint made durable: the cut right after it, what it covers, where."""

    cut: int
    keys: dict[Name, int]  # -> region id


def completed_checkpoints(fs: PowerCutFileSystem, root: str) -> list[Completed]:
    """The checkpoints the journal shows completed (renamed, then the directory
    synced), each with the keys its bytes name."""
    events = fs.events
    out = []
    renamed_at: Optional[int] = None
    root_node: Optional[int] = None
    for i, e in enumerate(events):
        if isinstance(e, Rename) and e.dst == "index.ckpt":
            renamed_at, root_node = i + 1, e.parent
        elif isinstance(e, SyncDir) and renamed_at is not None and e.node == root_node:
            data = fs.contents(renamed_at, os.path.join(root, "index.ckpt"))
            assert data is not None
            ck = decode_checkpoint(data)
            assert ck is not None
            keys = {(t.tenant, k): int(r) for t in ck.tenants for k, r in zip(t.keys, t.regions)}
            out.append(Completed(i + 1, keys))
            renamed_at = None
    return out


def unlinked_regions(events: list[Event]) -> set[int]:
    return {int(e.name.split(".")[0], 16) for e in events
            if isinstance(e, Unlink) and e.name.endswith(".region")}


def must_find(fs: PowerCutFileSystem, root: str, cut: int) -> set[Name]:
    """What the last checkpoint completed by ``cut`` covered, less the keys whose region
    file was removed before the cut (evicted since)."""
    done = [c for c in completed_checkpoints(fs, root) if c.cut <= cut]
    if not done:
        return set()
    gone = unlinked_regions(fs.events[:cut])
    return {name for name, region in done[-1].keys.items() if region not in gone}


def written_keys(events: list[Event]) -> dict[Name, int]:
    out = {}
    for e in events:
        if isinstance(e, Note) and e.text.startswith("written "):
            _, tenant, key = e.text.split(" ")
            out[(tenant, key)] = size_of(key)
    return out


def verify(fs: PowerCutFileSystem, root: str, cut: int, where: Path,
           rng: Optional[random.Random] = None, **kw) -> DiskStore:
    """Cut the power after ``cut`` journal entries, recover on the host's files, check
    every key ever written: found keys read exact bytes (or a damaged record: a miss),
    and every key :func:`must_find` names is found. Returns the closed store."""
    fs.image(cut, str(where), rng)
    must = must_find(fs, root, cut)
    image_root = str(where / os.path.relpath(root, fs_base(fs, root)))
    store = store_on(LOCAL, image_root, **kw)
    try:
        found = 0
        for (tenant, key), n in written_keys(fs.events).items():
            if not store.contains(tenant, key, n):
                assert (tenant, key) not in must, f"cut {cut}: {tenant}/{key} lost"
                continue
            found += 1
            buf = bytearray(n)
            got = store.read(tenant, key, memoryview(buf), time.monotonic() + 30)
            if got is ReadResult.HIT:
                assert bytes(buf) == value_of(tenant, key), f"cut {cut}: wrong bytes"
            else:
                assert got is ReadResult.DAMAGED, got
                assert (tenant, key) not in must, f"cut {cut}: {tenant}/{key} damaged"
        assert store.statistics().objects <= found  # nothing the test never wrote
    finally:
        store.close(clean=False)
    return store


def fs_base(fs: PowerCutFileSystem, root: str) -> str:
    return os.path.dirname(root)


@pytest.fixture
def rig(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    fs = PowerCutFileSystem(str(base))
    return fs, str(base / "store")


def test_a_cut_at_every_step_of_a_checkpoint_loses_nothing_it_covered(rig, tmp_path):
    fs, root = rig
    store = store_on(fs, root)
    for i in range(24):
        write(store, fs, "a" if i % 2 else "b", f"k-{i}")
    store.checkpoint()
    first = len(fs.events)
    for i in range(24, 48):
        write(store, fs, "abc"[i % 3], f"k-{i}")  # a new tenant: a new directory
    fs.note("checkpoint")
    start = len(fs.events)
    store.checkpoint()
    end = len(fs.events)
    store.close(clean=False)
    done = completed_checkpoints(fs, root)
    assert [c.cut for c in done][:2] == [first, end]  # both made durable, in order
    names = written_keys(fs.events)
    assert set(done[0].keys) == {n for n in names if int(n[1].split("-")[1]) < 24}
    assert set(done[1].keys) == set(names)
    assert end - start >= 8  # region syncs, directory syncs, temp file, rename, sync
    for cut in range(start, end + 1):
        verify(fs, root, cut, tmp_path / f"cut-{cut}")
    for cut in range(0, first + 1, 7):  # and through the first run, coarser
        verify(fs, root, cut, tmp_path / f"early-{cut}")


def test_torn_and_lucky_writes_around_a_checkpoint_never_give_wrong_bytes(rig, tmp_path):
    fs, root = rig
    store = store_on(fs, root)
    for i in range(30):
        write(store, fs, "a", f"k-{i}")
        if i == 14:
            store.checkpoint()
    fs.note("checkpoint")
    start = len(fs.events)
    store.checkpoint()
    end = len(fs.events)
    for i in range(30, 40):  # written after the last checkpoint: torn at the cut
        write(store, fs, "a", f"k-{i}")
    store.close(clean=False)
    for cut in range(start - 12, len(fs.events) + 1):
        for seed in range(2):
            rng = random.Random(cut * 10 + seed)
            verify(fs, root, cut, tmp_path / f"cut-{cut}-{seed}", rng)
    assert end > start


def test_a_cut_right_after_the_clean_marker_finds_everything_without_a_scan(rig, tmp_path):
    fs, root = rig
    store = store_on(fs, root)
    for i in range(20):
        write(store, fs, "a", f"k-{i}")
    store.checkpoint()
    for i in range(20, 30):
        write(store, fs, "b", f"k-{i}")
    fs.note("closing")
    start = len(fs.events)
    store.close(clean=True)
    end = len(fs.events)
    last = verify(fs, root, end, tmp_path / "end")
    st = last.statistics()
    assert st.scan_skipped and st.records_recovered == 30
    assert must_find(fs, root, end) == set(written_keys(fs.events))
    for cut in range(start, end):  # every step of the close: final checkpoint, marker
        image = verify(fs, root, cut, tmp_path / f"cut-{cut}")
        assert not image.scan_skipped or image.statistics().records_recovered == 30


def test_an_evicted_region_stays_gone_after_the_next_checkpoint(rig, tmp_path):
    fs, root = rig
    store = store_on(fs, root, capacity_bytes=6 * REGION)
    for i in range(60):
        write(store, fs, "a", f"k-{i}")
    store.checkpoint()
    store.close(clean=False)
    assert store.statistics().regions_evicted > 0
    ck = completed_checkpoints(fs, root)[-1]
    gone = unlinked_regions(fs.events[:ck.cut])
    assert gone
    fs.image(ck.cut, str(tmp_path / "image"))
    files = {int(p.name.split(".")[0], 16) for p in (tmp_path / "image").rglob("*.region")}
    assert not files & gone  # the unlinks were made durable before the checkpoint
    assert set(ck.keys.values()) <= files  # every region it names is there
    verify(fs, root, ck.cut, tmp_path / "check", capacity_bytes=6 * REGION)


def test_kill_9_then_a_checkpoint_then_a_power_cut(rig, tmp_path):
    """A store killed (its page cache kept, nothing made durable after its last
    checkpoint) is recovered by a scan; the next store's first checkpoint must make
    what the scan found durable, names included, before it names it."""
    fs, root = rig
    store = store_on(fs, root)
    for i in range(10):
        write(store, fs, "a", f"k-{i}")
    store.checkpoint()
    for i in range(10, 30):
        write(store, fs, "abc"[i % 3], f"k-{i}")
    # kill -9: the descriptors go, nothing else is written
    for f in store._files.values():
        f.close()
    fs.close(store._lock_fd)
    store._lock_fd = -1
    store._state = DiskState.OFF
    again = store_on(fs, root)
    assert again.statistics().records_recovered == 30
    again.checkpoint()
    cut = len(fs.events)
    again.close(clean=False)
    assert must_find(fs, root, cut) == set(written_keys(fs.events))
    verify(fs, root, cut, tmp_path / "cut")


def test_random_cuts_under_concurrent_saves(rig, tmp_path):
    fs, root = rig
    capacity = 12 * REGION
    store = store_on(fs, root, capacity_bytes=capacity, checkpoint_s=0.01)
    errors: list[AssertionError] = []

    def saver(t: int) -> None:
        try:
            for i in range(50):
                write(store, fs, "ab"[t % 2], f"t{t}-{i}")
                if i % 10 == 9:
                    time.sleep(0.005)  # let the timer's checkpoints interleave
        except AssertionError as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    store.checkpoint()  # at least one, whatever the timer managed
    store.close(clean=True)
    assert not errors, errors
    assert store.statistics().regions_evicted > 0
    done = completed_checkpoints(fs, root)
    assert len(done) >= 2
    rng = random.Random(28)
    n = len(fs.events)
    cuts = sorted(rng.sample(range(n + 1), 22)) + [c.cut for c in done[-2:]]
    covered = 0
    for k, cut in enumerate(cuts):
        luck = random.Random(cut) if k % 2 else None
        verify(fs, root, cut, tmp_path / f"cut-{k}", luck, capacity_bytes=capacity)
        covered += len(must_find(fs, root, cut))
    assert covered > 0


def test_a_region_evicted_before_the_checkpoint_that_comes_back_is_removed(tmp_path):
    """A power cut can bring back a region file whose removal was not durable yet; one
    the last checkpoint does not name although it was made before it (its id is below
    the checkpoint's next region) was evicted before the checkpoint: recovery removes
    it instead of serving its records again."""
    root = tmp_path / "store"
    store = store_on(LOCAL, str(root), capacity_bytes=4 * REGION)
    for i in range(40):
        assert store.write("a", f"k-{i}", value_of("a", f"k-{i}")) is WriteResult.WRITTEN
    assert store.statistics().regions_evicted > 0
    store.close(clean=False)
    files = sorted(root.rglob("*.region"))
    live = {int(p.name.split(".")[0], 16) for p in files}
    evicted = min(set(range(1, max(live))) - live)
    back = files[0].with_name(f"{evicted:016x}.region")
    back.write_bytes(files[0].read_bytes())  # the file of a live region, under an old id
    got = recover(str(root), 4 * REGION, REGION, clean=False)
    assert got.stale_regions_removed == 1 and not back.exists()
    again = store_on(LOCAL, str(root), capacity_bytes=4 * REGION)
    try:
        assert again.statistics().regions == len(live)
    finally:
        again.close()


def test_no_clean_marker_while_a_write_is_still_in_flight(tmp_path, monkeypatch):
    """The marker lets the next open skip the scan, so it vouches that the last
    checkpoint covers every record: a write still running when the close gave up
    waiting is written after that checkpoint, and only a scan finds it."""
    import ems.disk.store as store_module

    monkeypatch.setattr(store_module, "CLOSE_WAIT_S", 0.05)
    root = tmp_path / "store"
    store = store_on(LOCAL, str(root), io_delay_s=0.5)  # every pwritev sleeps first
    done: list[WriteResult] = []
    writer = threading.Thread(target=lambda: done.append(
        store.write("a", "k-1", value_of("a", "k-1"))))
    writer.start()
    try:
        time.sleep(0.2)  # the write is in its pwritev's delay
        store.close(clean=True)
        assert not (root / "clean").exists()
    finally:
        writer.join(10)
    assert done == [WriteResult.WRITTEN]
    again = store_on(LOCAL, str(root))
    try:
        assert not again.scan_skipped
        buf = bytearray(size_of("k-1"))
        assert again.read("a", "k-1", memoryview(buf), time.monotonic() + 10) is ReadResult.HIT
        assert bytes(buf) == value_of("a", "k-1")
    finally:
        again.close()
