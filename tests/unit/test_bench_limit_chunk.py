"""The read size of ``ems bench --disk``'s device read limit: whole requests of the
directory's device (``max_segments`` pages less one, at most ``max_sectors_kb``), as
many as fit in the tier's read chunk; the tier's chunk where sysfs has no answer."""

import os

import pytest

from ems.bench.disk import READ_CHUNK_BYTES, limit_read_chunk
from ems.disk.records import ALIGN


def _queue(root, dev: int, segments: str, sectors_kb: str, partition: bool = False) -> None:
    """A sysfs tree under ``root`` whose block device ``dev`` has these queue limits (as
    a partition: ``dev`` links to a directory inside its disk's, which holds the queue,
    as /sys/dev/block/M:m links into /sys/devices on a real host)."""
    disk = root / "devices" / "vda"
    node = disk / "vda1" if partition else disk
    node.mkdir(parents=True)
    (disk / "queue").mkdir()
    (disk / "queue" / "max_segments").write_text(segments + "\n")
    (disk / "queue" / "max_sectors_kb").write_text(sectors_kb + "\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(node)


@pytest.mark.parametrize("segments,sectors_kb,partition,want_kib", [
    ("254", "4096", False, 1012),  # virtio: 253 pages a request, one a read
    ("254", "4096", True, 1012),  # a file system on a partition: its disk's queue
    ("128", "512", False, 1016),  # two requests of 127 pages
    ("1024", "128", False, 1024),  # eight requests of 128 KiB
    ("2", "4096", False, 1024),  # one page a request: 256 of them
    ("4096", "8192", False, 1024),  # requests larger than the chunk: the chunk
])
def test_the_limit_reads_whole_device_requests(tmp_path, segments, sectors_kb, partition,
                                                want_kib):
    assert READ_CHUNK_BYTES == 1 << 20
    data = tmp_path / "data"
    data.mkdir()
    _queue(tmp_path / "sys", os.stat(data).st_dev, segments, sectors_kb, partition)
    got = limit_read_chunk(data, str(tmp_path / "sys"))
    assert got == want_kib << 10 and got % ALIGN == 0


@pytest.mark.parametrize("segments,sectors_kb", [("", "4096"), ("x", "4096"), ("1", "4096"),
                                                 ("0", "4096"), ("254", "2")])
def test_unreadable_or_useless_limits_read_the_tiers_chunk(tmp_path, segments, sectors_kb):
    data = tmp_path / "data"
    data.mkdir()
    _queue(tmp_path / "sys", os.stat(data).st_dev, segments, sectors_kb)
    assert limit_read_chunk(data, str(tmp_path / "sys")) == READ_CHUNK_BYTES


def test_no_sysfs_entry_or_no_directory_reads_the_tiers_chunk(tmp_path):
    assert limit_read_chunk(tmp_path, str(tmp_path / "nosys")) == READ_CHUNK_BYTES
    assert limit_read_chunk(tmp_path / "gone") == READ_CHUNK_BYTES


@pytest.mark.parametrize("segments,sectors_kb,want_kib", [
    ("254", "4096", 1024),  # a huge page is one segment: a request is max_sectors_kb
    ("254", "512", 1024),  # two requests of 512 KiB
])
def test_into_huge_pages_a_request_is_its_sectors(tmp_path, segments, sectors_kb, want_kib):
    data = tmp_path / "data"
    data.mkdir()
    _queue(tmp_path / "sys", os.stat(data).st_dev, segments, sectors_kb)
    assert limit_read_chunk(data, str(tmp_path / "sys"), page=2 << 20) == want_kib << 10
