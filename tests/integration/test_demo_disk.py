"""`ems demo --disk`: a shared-memory pool smaller than the working set hits more with
the disk tier than without, still hits from the disk after a restart, and every pass
produces the outputs of the run without ems."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: 3 prefixes of 256 tokens, 32 KiB per block: 1.9 MiB of KV through the daemon's least
#: pool, 1 MiB; the prefixes' requests interleave, so shared memory alone never hits
SMALL = ["--prefixes", "3", "--requests", "2", "--prefix-tokens", "256", "--suffix-tokens",
         "32", "--decode-tokens", "2", "--layers", "4", "--hidden", "256", "--vocab", "256",
         "--block-size", "16", "--threads", "1", "--no-progress"]


@pytest.mark.timeout(240)  # four passes of a model on a shared machine
def test_disk_keeps_what_shared_memory_evicts_and_survives_a_restart(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "ems", "demo", *SMALL, "--disk",
                           "--json", str(out)], capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "after restart" in proc.stdout and "identical" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["shm_bytes"] < report["kv"]["distinct_bytes"]
    shm_only, disk, restarted = report["passes"]
    assert [p["ok"] for p in report["passes"]] == [True, True, True]
    assert shm_only["pool"]["evictions"] > 0 and shm_only["pool"]["disk_hits"] == 0
    # the disk tier served what shared memory had evicted
    assert disk["hit_rate"] > shm_only["hit_rate"]
    assert disk["pool"]["disk_hits"] > 0
    # after the restart shared memory is empty: the hits come from the disk
    assert restarted["records_recovered"] > 0
    assert restarted["pool"]["disk_hits"] > 0
    assert restarted["hit_rate"] > shm_only["hit_rate"]
    assert report["hit_rate"] == {"shm_only": shm_only["hit_rate"],
                                  "disk": disk["hit_rate"],
                                  "after_restart": restarted["hit_rate"]}
