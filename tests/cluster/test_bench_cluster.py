"""`ems bench --systems cluster`: the cross-host rows run (structure, never speed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_quick_cross_host_rows(tmp_path):
    pytest.importorskip("numpy")
    pytest.importorskip("valkey")
    import ems
    src = os.path.dirname(os.path.dirname(os.path.abspath(ems.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ems.bench", "--quick", "--systems",
                           "cluster", "--workloads", "v0", "--no-plot", "--no-progress",
                           "--out", str(out)], capture_output=True, text=True, timeout=200,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    systems = ["memcpy", "ems-cluster", "valkey-py"]
    problems = data["problems"]
    if importlib.util.find_spec("mooncake") is None:  # the peer is optional: said why
        assert [p["system"] for p in problems] == ["mooncake-tcp", "mooncake-tcp-node"], \
            problems
        assert all("not installed" in p["reason"] for p in problems)
    else:
        assert not problems, problems
        systems += ["mooncake-tcp", "mooncake-tcp-node"]
    rows = {(r["system"], r["op"], r["value_bytes"]) for r in data["results"]}
    sizes = {r["value_bytes"] for r in data["results"]}
    for size in sizes:
        for system in systems:
            for op in ("save", "load"):
                assert (system, op, size) in rows
