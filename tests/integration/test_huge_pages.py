"""Shared memory of huge pages (``ems-server --huge-pages``): a real daemon whose
tenant segment is a hugetlb memfd; the client maps it, a disk tier writes from it and
reads back into it with O_DIRECT, byte for byte; ``auto`` falls back to 4 KiB pages
where there are none, ``on`` refuses to start. The test reserves the huge pages it
needs (``vm.nr_hugepages``, root only) and gives them back after."""

from __future__ import annotations

import os
import time

import pytest
from support.client_worker import Value, pattern

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.server.tenants import huge_page_bytes, meminfo_kib
from ems.stats import format_report

pytestmark = pytest.mark.integration

MIB = 1 << 20
_NR = "/proc/sys/vm/nr_hugepages"


def _meminfo(field: str) -> int:
    value = meminfo_kib(field)
    if value is None:
        raise KeyError(field)
    return value


def _set_pages(n: int) -> bool:
    try:
        with open(_NR, "w") as f:
            f.write(str(n))
    except OSError:
        return False
    return True


@pytest.fixture
def hugetlb():
    """``hugetlb(n)``: at least ``n`` free huge pages (skips where they cannot be had);
    the reservation as it was at teardown."""
    if not huge_page_bytes() or not os.access(_NR, os.W_OK):
        pytest.skip("needs huge pages and root (vm.nr_hugepages)")
    with open(_NR) as f:
        before = int(f.read())

    def reserve(n: int) -> None:
        free = _meminfo("HugePages_Free")
        if free < n and not (_set_pages(before + n - free)
                             and _meminfo("HugePages_Free") >= n):
            pytest.skip(f"could not reserve {n} huge pages")
    yield reserve
    _set_pages(before)


def _cc(client_env, server):
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="huge")))
    return Ems.get_cc()


def test_a_disk_tier_spills_and_loads_through_huge_pages(hugetlb, make_server, client_env,
                                                           tmp_path):
    """48 MiB through 16 MiB of shared memory in huge pages: every value spilled to
    disk from them and read back into them, byte for byte; the segment's pages are
    the system's huge pages while the daemon runs."""
    page = huge_page_bytes()
    assert page
    hugetlb(16 * MIB // page + 1)
    free = _meminfo("HugePages_Free")
    server = make_server(capacity="15M", extra_args=[  # (rounded up to whole pages)
        "--huge-pages", "on", "--disk", str(tmp_path / "disk"), "--disk-checkpoint-s", "60"])
    assert free - _meminfo("HugePages_Free") == -(-15 * MIB // page)  # taken at start
    try:
        cc = _cc(client_env, server)
        keys = [f"huge-{i}" for i in range(48)]
        for lo in range(0, 48, 4):
            vals = [Value(MIB, pattern(k, MIB)) for k in keys[lo:lo + 4]]
            assert cc.save(CcKvOption(timeout=5000), keys[lo:lo + 4],
                           [v.wrappers() for v in vals]).success == 4
        deadline = time.monotonic() + 30
        while True:
            d = server.stats()["disk"]
            if d["objects"] >= 48 and not d["queued_write_bytes"] and \
                    not d["inflight_write_bytes"]:
                break
            assert time.monotonic() < deadline, "the disk tier never settled"
            time.sleep(0.05)
        outs = [Value(MIB) for _ in keys[:12]]  # evicted long ago: on disk only
        assert cc.load(CcKvOption(timeout=20000), keys[:12],
                       [o.wrappers() for o in outs]).success == 12
        assert all(o.bytes() == pattern(k, MIB) for k, o in zip(keys, outs))
        stats = server.stats()
        row = stats["tenants"]["(anonymous)"]
        assert row["huge_pages"] is True
        memory = format_report(stats).split("memory:")[1].splitlines()
        assert memory[1].split()[-1] == "pages" and memory[2].split()[-1] == "huge"
        assert row["tiers"]["disk"]["hits"] >= 12
        assert stats["disk"]["direct_reads"] >= 1  # O_DIRECT into the huge pages
    finally:
        Ems.finalize()


def test_auto_falls_back_and_on_refuses_without_huge_pages(hugetlb, make_server,
                                                            client_env, tmp_path):
    """No huge page free: ``auto`` serves from 4 KiB pages (and says so in its log and
    report); ``on`` does not start, and says why."""
    hugetlb(0)
    with open(_NR) as f:
        before = int(f.read())
    if _meminfo("HugePages_Free") and not _set_pages(before - _meminfo("HugePages_Free")):
        pytest.skip("huge pages in use elsewhere")
    try:
        assert _meminfo("HugePages_Free") == 0
        server = make_server(capacity="8M", extra_args=["--huge-pages", "auto"])
        try:
            cc = _cc(client_env, server)
            val = Value(MIB, pattern("k", MIB))
            assert cc.save(CcKvOption(timeout=5000), ["k"], [val.wrappers()]).success == 1
            out = Value(MIB)
            assert cc.load(CcKvOption(timeout=5000), ["k"], [out.wrappers()]).success == 1
            assert out.bytes() == pattern("k", MIB)
            assert server.stats()["tenants"]["(anonymous)"]["huge_pages"] is False
            assert "of 4 KiB pages" in server.log()
        finally:
            Ems.finalize()
        with pytest.raises(RuntimeError, match="huge pages"):
            make_server(capacity="8M", extra_args=["--huge-pages", "on"])
    finally:
        _set_pages(before)
