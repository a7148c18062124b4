"""`ems bench --quick` on the embedded pool only, so the bench cannot rot.

Asserts structure (table rows, JSON keys), never speed: timings on a shared machine
are noise. Runs the bench as a subprocess (its own process: the bench spawns workers,
and pytest's warnings-as-errors must not judge third-party plotting code).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from ems.bench.runner import main
from ems.client import native

#: the limit kernels this build has (copy-nt needs the native helper)
LIMITS = (("copy-nt",) if native.available() else ()) + ("copy-glibc",)


@pytest.mark.slow
def test_bench_quick_embedded_only(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ems.bench", "--quick", "--systems", "embedded",
         "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    data = json.loads((out / "bench.json").read_text())
    for key in ("schema", "date", "elapsed_s", "machine", "ems", "args", "peers", "results",
                "latency", "fill_series", "problems", "targets"):
        assert key in data, key
    assert data["machine"]["cpus"] >= 1
    assert data["ems"]["version"]
    assert data["args"]["systems"] == ["memcpy", "ems-embedded"]

    rows = data["results"]
    v0 = {(r["system"], r["op"], r["value_bytes"]) for r in rows if r["workload"] == "v0"}
    sizes = {r["value_bytes"] for r in rows if r["workload"] == "v0"}
    assert len(sizes) == 3
    for size in sizes:
        for system in ("memcpy", *LIMITS, "ems-embedded"):
            for op in ("save", "load"):
                assert (system, op, size) in v0
    for r in rows:
        assert r["gbps"] > 0 and len(r["seconds"]) >= 1
        assert r["ratio_to_memcpy"] is not None, r
        if r["workload"] in ("v0", "v1"):  # the honest limit: the best kernel's runs
            assert r["ratio_to_limit"] is not None, r
    workloads = {r["workload"] for r in rows}
    assert {"v0", "fill", "scaling"} <= workloads
    if importlib.util.find_spec("torch") is not None:
        assert {r["system"] for r in rows if r["workload"] == "v1"} == {
            "memcpy", *LIMITS, "ems-embedded"}
    assert {r["system"] for r in rows if r["workload"] == "fill"} == {"memcpy",
                                                                      "ems-embedded"}
    lat = {(x["system"], x["op"]): x for x in data["latency"]}
    for op in ("save", "load"):
        x = lat[("ems-embedded", op)]
        assert x["n"] > 0 and 0 < x["p50_us"] <= x["p99_us"]
        assert len(x["cdf_us"]) == 101
    # the daemon was not asked for: the workload that needs it says so, not silently
    assert any(p["system"] == "ems-daemon" and p["workload"] == "scaling"
               for p in data["problems"])
    assert {t["system"] for t in data["targets"]} == {"ems-embedded"}

    table = proc.stdout
    assert "| workload | case | system | op | GB/s | x limit | x memcpy |" in table
    assert table.count("| v0 |") == 3 * (2 + len(LIMITS)) * 2  # sizes x systems x ops
    assert "| ems-embedded | save |" in table  # latency table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 10_000
    else:
        assert "no plot: matplotlib is not installed" in table


def test_bench_rejects_unknown_names():
    with pytest.raises(SystemExit, match="unknown system 'memcache'"):
        main(["--systems", "memcache"])
    with pytest.raises(SystemExit, match="unknown workload"):
        main(["--workloads", "v9"])


def test_gpu_check_without_cuda_exits_cleanly_with_one_line():
    """``benchmarks/gpu_check.py`` on a machine without CUDA (this one, in CI): exit 0,
    one line saying why, no JSON written."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the script would run for real")
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--json", "/nonexistent/x.json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), proc.stdout


def test_the_gpu_table_renders_what_gpu_check_writes():
    """One renderer for the script's output and the docs' block: a result of the shape
    ``gpu_check.py --json`` writes gives one header, a row per throughput figure and
    the stall line; a wrong copy is shown as such."""
    from ems.bench.gpu import gpu_table
    row = {"api": "v1", "run_bytes": 2 << 20, "op": "load", "gbps": 40.0,
           "pinned_gbps": 50.0, "pageable_gbps": 10.0, "pinned_bulk_gbps": 52.0,
           "x_pinned": 0.8, "x_pageable": 4.0}
    result = {"date": "2026-12-02T08:00:00+00:00", "elapsed_s": 99.0, "device": "GPU X",
              "machine": {"torch": "2.13.0", "cuda": "12.8", "ems": "0.1.0"},
              "registration": {"refusals": 0, "registered_bytes": 8 << 30, "seconds": 1.5},
              "exact": {"v1_fp16": True, "v0": False}, "throughput": [row, dict(row, op="save")],
              "stall": {"alone_ms": 1.0, "with_saves_ms": 1.05, "ratio": 1.05,
                        "blocks_saved": 12}}
    text = gpu_table(result)
    assert "8192 MiB registered" in text and "v0 **WRONG**" in text
    assert "| V1 | 2 MiB | load | 40.0 | 50.0 | 0.80 | 10.0 | 4.00 | 52.0 |" in text
    assert "(×1.050; 12 blocks" in text


def test_a_run_records_the_commit_it_began_on_marked_dirty_if_it_moved():
    """A run records the commit of the code it imported when it began; when the
    checkout is another commit by its end (a process it started later imported other
    code), it is marked dirty, never named clean as the later commit."""
    from ems.bench.report import commit
    now = commit()
    if "commit" not in now:
        pytest.skip("ems is not a git checkout here")
    assert commit(since=now) == now  # nothing moved: the start as it was
    before = {**now, "commit": "0" * 40, "dirty": False}
    moved = commit(since=before)
    assert moved["commit"] == "0" * 40 and moved["dirty"] is True
