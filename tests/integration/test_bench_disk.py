"""`ems bench --disk` at tiny sizes: the disk tier through a real daemon, beside the
device's limit, so the bench cannot rot.

Asserts what the tier did (objects beyond shared memory written, loaded back from the
disk, found after a restart), never speed: timings on a shared machine are noise.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MIB = 1 << 20


def test_bench_disk_tiny(tmp_path):
    out, where = tmp_path / "out", tmp_path / "disk"
    proc = subprocess.run(
        [sys.executable, "-m", "ems.bench", "--disk", "--disk-mib", "16", "--disk-reps", "1",
         "--disk-shm-mib", "4", "--disk-records", "5000", "--disk-scan", "500", "--out",
         str(out), "--disk-dir", str(where)],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "V0 1 MiB" in proc.stdout and "checkpoint load" in proc.stdout
    assert list(where.iterdir()) == []  # its temp dir is gone

    data = json.loads((out / "bench-disk.json").read_text())
    assert data["threads"] >= 1 and data["shm_bytes"] == 4 * MIB
    assert data["huge_pages"] in (True, False)  # auto: as the machine has them
    assert ("huge pages" if data["huge_pages"] else "4 KiB pages") in proc.stdout
    assert [s["size"] for s in data["sizes"]] == [MIB, 256 << 10, 16 << 10]
    assert data["reps"] == 1 and all(len(s["runs"]) == 1 for s in data["sizes"])
    for s in data["sizes"]:
        assert s["count"] * s["size"] == 16 * MIB
        # more than shared memory holds reached the disk...
        assert s["bytes_written"] > 2 * s["shm_bytes"], s
        # ...the evicted objects came back from it...
        assert s["load_evicted_objects"] > 0
        assert s["load_evicted_disk_hits"] >= s["load_evicted_found"] > 0, s
        # ...and after a restart (shared memory empty) the disk served the loads
        assert s["scan_skipped"] and 0 < s["records_recovered"] <= s["count"]
        assert s["load_restart_disk_hits"] >= s["load_restart_found"], s
        assert s["load_restart_found"] >= s["count"] - s["evicted_before_write"] > 0, s
        for key in ("limit_write_gbps", "limit_read_gbps", "spill_gbps", "load_restart_gbps",
                    "spill_ratio", "load_restart_ratio"):
            assert s[key] > 0, key
        assert s["store"]["write_gbps"] > 0 and s["store"]["read_gbps"] > 0
        # bytes, not time: the batch heads and padding are counted, and small
        assert s["disk_bytes_written"] > s["bytes_written"], s
        assert 0 < s["header_overhead"] < 0.02, s
        assert s["limit_write_gbps"] >= s["limit_write_value_gbps"]
        assert s["limit_write_gbps"] >= s["limit_write_regions_gbps"] > 0
        # each run's ratios are against that run's own limits: the write limit taken
        # around it, the read limit the reads of its region files beside each load
        run = s["runs"][0]
        assert run["spill_ratio"] == run["spill_gbps"] / run["limit_write_gbps"]
        assert run["limit_read_gbps"] == run["limit_read_restart_gbps"] > 0
        assert run["load_restart_ratio"] == run["load_restart_gbps"] / run["limit_read_gbps"]
        assert run["load_evicted_ratio"] == (run["load_evicted_gbps"]
                                             / run["limit_read_evicted_gbps"])
        assert run["limit_read_value_gbps"] > 0 and run["limit_read_chunk_gbps"] > 0
        assert s["unwritten"] >= s["evicted_before_write"] >= 0  # counted, not timed
    assert data["checkpoint"]["records"] == 5000 and data["checkpoint"]["load_s"] > 0
    assert data["scan"]["records"] == 500 and data["scan"]["scan_s"] > 0
