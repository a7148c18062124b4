"""``ems demo --hosts 2``: host 2 hits through the cluster what host 1 saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ems.testing.process import terminate

pytestmark = pytest.mark.slow


@pytest.mark.torch
@pytest.mark.timeout(300)  # two demo instances and a cluster: ~110 s on a loaded 2-core VM
def test_demo_with_two_hosts(tmp_path):
    pytest.importorskip("torch")
    import ems
    src = os.path.dirname(os.path.dirname(os.path.abspath(ems.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    out = tmp_path / "demo.json"
    proc = subprocess.Popen([sys.executable, "-m", "ems", "demo", "--hosts", "2",
                             "--prefixes", "2", "--requests", "3", "--prefix-tokens", "256",
                             "--suffix-tokens", "32", "--no-progress", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:  # however the test ends, the demo is stopped by its pid (SIGTERM: it stops its
        stdout, stderr = proc.communicate(timeout=280)  # cluster and daemons first)
    finally:
        terminate(proc, 30.0)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == 0, stdout + stderr
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["hosts"]) == 2
    first, second = (h["tiers"] for h in report["hosts"])
    assert first["cluster_bytes_out"] > 0  # host 1 wrote behind what it computed
    assert second["cluster_hits"] > 0 and second["cluster_misses"] == 0
    assert all(h["comparison"]["ok"] for h in report["hosts"])
    assert "[host 2] tiers: local pool" in stdout
