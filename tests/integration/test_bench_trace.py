"""`ems bench --trace` end to end on a tiny synthetic trace, through the embedded pool
and a real ems-server, so the replay cannot rot.

Asserts what the replay measured (every field of the JSON, exact LRU on the embedded
pool, 0 wrong bytes), never speed: timings on a shared machine are noise.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.traces import synthetic_lines, write_trace

from ems.bench.trace_sim import belady, infinite, load_trace, lru

pytestmark = pytest.mark.integration

SYSTEM_FIELDS = ("hit_rate", "hits", "blocks", "exists_hits", "short_loads", "save_refused",
                 "wrong_bytes", "fill", "stats", "requests", "requests_per_s",
                 "request_p50_ms", "request_p99_ms", "lookup_p50_us", "lookup_p99_us",
                 "probe", "wall_s")


def test_bench_trace_tiny(tmp_path):
    path = write_trace(tmp_path / "tiny.jsonl.xz", synthetic_lines(300, seed=4))
    out = tmp_path / "out" / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ems.bench", "--trace", str(path), "--capacities", "100,400",
         "--block-bytes", "16384", "--trace-systems", "embedded,daemon", "--json", str(out)],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| tiny |" in proc.stdout and "optimum" in proc.stdout

    data = json.loads(out.read_text())
    assert data["block_bytes"] == 16384 and data["capacities"] == [100, 400]
    assert data["systems"] == ["ems-embedded", "ems-daemon"] and data["problems"] == []
    trace = load_trace(str(path))
    [t] = data["traces"]
    assert (t["requests"], t["blocks"], t["distinct"]) == (300, trace.blocks, trace.distinct)
    assert t["infinite_hit_rate"] == infinite(trace).hit_rate
    for c, cap in zip(t["capacities"], (100, 400)):
        assert c["capacity_blocks"] == cap and c["capacity_bytes"] == cap * 16384
        assert c["lru_hit_rate"] == lru(trace, cap).hit_rate
        assert c["belady_hit_rate"] == belady(trace, cap).hit_rate
        assert set(c["systems"]) == {"ems-embedded", "ems-daemon"}
        for name, s in c["systems"].items():
            for key in SYSTEM_FIELDS:
                assert key in s, (name, key)
            assert s["wrong_bytes"] == 0 and s["probe"]["wrong_bytes"] == 0, (name, s)
            assert s["blocks"] == trace.blocks and s["requests"] == 300
            assert 0 < s["hits"] <= s["exists_hits"]
            assert 0 < s["fill"] <= 1
            for key in ("one_key_p50_us", "lookup_p50_us", "ratio_p50"):
                assert s["probe"][key] > 0
        # the embedded pool is exact LRU on this access pattern
        assert c["systems"]["ems-embedded"]["hits"] == lru(trace, cap).hits
