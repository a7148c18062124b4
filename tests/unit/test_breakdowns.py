"""The disk breakdown scripts (``benchmarks/disk_*_breakdown.py``) run end to end on a
real daemon, so they cannot rot: small working sets, structure only (table rows, the
JSON's fields), never speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, out: Path) -> tuple[str, dict]:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--out", str(out), "--mib", "8",
         "--shm-mib", "4", "--huge-pages", "off"],
        capture_output=True, text=True, timeout=240, cwd=out,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = script.removesuffix(".py")
    data = json.loads((out / f"{name}.json").read_text())
    assert not (out / f"{name.replace('_', '-')}.tmp").exists()  # the work dir went
    for key in ("date", "argv", "ems", "mib", "shm_mib", "huge_pages", "rows", "loadavg"):
        assert key in data, key
    assert data["argv"][:2] == ["--out", "DIR"] and data["mib"] == 8
    return proc.stdout, data


def _row_lines(table: str, name: str) -> int:
    return sum(1 for line in table.splitlines() if line.startswith(f"| {name} |"))


@pytest.mark.slow
def test_the_spill_breakdown_times_every_step_of_a_save(tmp_path):
    table, data = _run("disk_spill_breakdown.py", tmp_path)
    rows = data["rows"]
    assert [r["size"] for r in rows] == [1 << 20, 256 << 10, 16 << 10]
    for r in rows:
        assert _row_lines(table, r["name"]) == 1
        assert r["count"] == (8 << 20) // r["size"] and r["values_per_s"] > 0
        for key in ("reserve_wait_us", "copy_us", "commit_wait_us", "client_cpu_us",
                    "daemon_loop_cpu_us", "daemon_threads_cpu_us", "after_saves_ms"):
            assert r[key] >= 0, key
        assert r["copy_us"] > 0  # every value was copied by the client
        assert r["device_busy"] is None or 0 <= r["device_busy"] <= 1.5
    assert data["cpus"] == os.cpu_count()


@pytest.mark.slow
def test_the_load_breakdown_times_every_part_of_a_load(tmp_path):
    table, data = _run("disk_load_breakdown.py", tmp_path)
    rows = data["rows"]
    assert [r["size"] for r in rows] == [1 << 20, 256 << 10]
    for r in rows:
        assert _row_lines(table, r["name"]) == 1
        assert r["found"] == (8 << 20) // r["size"]  # every object came back
        assert r["load_gbps"] > 0 and r["device_gbps"] > 0
        assert sum(r["parts"]) == r["load_bytes"]
