"""`ems demo --instances 2`: two processes share one daemon; the second hits the first's
saves, and both produce the outputs of the run without ems."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ems.testing import run_server

pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["--prefixes", "2", "--requests", "2", "--prefix-tokens", "64", "--suffix-tokens",
         "20", "--decode-tokens", "3", "--layers", "2", "--hidden", "64", "--vocab", "256",
         "--block-size", "16", "--threads", "1", "--no-progress"]


def test_two_instances_share_the_daemon(tmp_path):
    out = tmp_path / "demo.json"
    with run_server(capacity="32M") as server:
        env = dict(os.environ, **server.client_env())
        proc = subprocess.run([sys.executable, "-m", "ems", "demo", *SMALL, "--instances", "2",
                               "--json", str(out)], env=env, capture_output=True, text=True,
                              timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True
    first, second = report["instances"]
    blocks = 64 // 16  # full prefix blocks of each request
    # instance 1: every request but the first of each prefix loads the prefix
    assert first["ems"]["totals"]["loaded_tokens"] == 2 * (2 - 1) * blocks * 16
    # instance 2 (a new process): the first request of each prefix hits too
    assert second["ems"]["totals"]["loaded_tokens"] > first["ems"]["totals"]["loaded_tokens"]
    assert second["ems"]["totals"]["loaded_tokens"] >= 2 * 2 * blocks * 16
