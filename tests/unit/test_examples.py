"""Every script in examples/ runs on the embedded pool, exits 0 and prints what its
samples promise. The scripts run in parallel subprocesses (each imports torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the examples adapt the seeds' torch samples
pytestmark = pytest.mark.torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TENANT_KEY = "c2VjcmV0LWtleS1mb3ItZXhhbXBsZXMtMDEyMzQ1Njc4OQ=="

# (run id, script, extra env, lines the output must contain (line: count))
RUNS = {
    "quickstart": ("quickstart.py", {}, {
        "saved: CcResult(success=2, total=2)": 1,
        "loaded: CcResult(success=2, total=2)": 1,
        "bytes equal: True": 1,
    }),
    "v0_sync_save_load": ("v0_sync_save_load.py", {}, {
        "CcResult(success=1, total=1)": 2,
        "loaded tensor equals saved tensor: True": 1,
        "CcResult(success=2, total=2)": 3,
        "succeed to load key num 2.": 1,
        "loaded tensors equal saved tensors: True": 1,
    }),
    "v0_async": ("v0_async.py", {}, {
        "result:CcResult(success=2, total=2)": 4,
        "result:CcResult(success=1, total=1)": 4,
        "saved for the load sample: CcResult(success=3, total=3)": 1,
        "get_result: CcResult(success=1, total=1)": 1,
        "loaded tensors equal saved tensors: True": 1,
    }),
    "v1_slot_mapping": ("v1_slot_mapping.py", {}, {
        "CcResult(success=2, total=2)": 1,
        "exists: CcResult(success=2, total=3)": 1,
        "saved:CcResult(success=2, total=2)": 2,
        "result:CcResult(success=2, total=2)": 2,
        "loaded KV equals saved KV: True": 1,
    }),
    "v1_chunk_descs": ("v1_chunk_descs.py", {}, {
        "CcResult(success=2, total=2)": 1,
        "saved:CcResult(success=2, total=2)": 2,
        "result:CcResult(success=2, total=2)": 4,
        "loaded KV equals saved KV: True": 1,
        "hybrid save: CcResult(success=2, total=2)": 1,
        "hybrid load: CcResult(success=2, total=2)": 1,
        "hybrid loaded KV equals saved KV: True": 1,
    }),
    "v1_register_kvcache": ("v1_register_kvcache.py", {}, {
        "register_kvcache: ok": 1,
        "saved: CcResult(success=2, total=2)": 1,
        "loaded: CcResult(success=2, total=2)": 1,
        "loaded KV equals saved KV: True": 1,
    }),
    "init_and_errors": ("init_and_errors.py", {}, {
        "health: True": 1,
        "load of a key never saved: CcResult(success=0, total=1)": 1,
        "failed to load, message: key_list[0] length must be 1..127, got 128.": 1,
        "status code: EMS_INVALID_ARGUMENT": 1,
        "second init: EMS_ALREADY_INITIALIZED": 1,
        "initialized without keys: True": 1,
        "initialized with access_id=None: True": 1,
    }),
    "kv_router": ("kv_router.py", {}, {
        "prefix held: pick host-a (score 4.00)": 1,
        "after host-a evicted block 0: pick host-b (score 3.00)": 1,
        "unknown prompt: pick None (score 0.00)": 1,
    }),
    "init_and_errors-tenant": ("init_and_errors.py",
                               {"access_id": "tenant-a", "access_key": TENANT_KEY}, {
        "initialized with access_id=tenant-a: True": 1,
    }),
}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("EMS_SOCKET_DIR", "EMS_WORKERS", "access_id", "access_key")}
    env.update(EMS_POOL="embedded", EMS_CAPACITY="64M", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every run at once; each test then waits for its own."""
    cwd = tmp_path_factory.mktemp("examples")  # no reliance on the repo as cwd
    procs = {
        name: subprocess.Popen([sys.executable, str(EXAMPLES / script)], cwd=cwd,
                               env=_env(extra), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        for name, (script, extra, _) in RUNS.items()
    }
    yield procs
    for p in procs.values():  # every run, also those no selected test waited for
        if p.poll() is None:
            p.kill()
        p.wait()
        for pipe in (p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()


def test_every_example_is_run():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == {script for script, _, _ in RUNS.values()}


@pytest.mark.parametrize("name", list(RUNS))
def test_example_runs(runs, name):
    try:
        out, err = runs[name].communicate(timeout=90)
    except subprocess.TimeoutExpired:
        runs[name].kill()
        pytest.fail(f"{name} did not finish in 90 s")
    assert runs[name].returncode == 0, f"exit {runs[name].returncode}\n{out}\n{err}"
    assert "Traceback" not in err, err
    lines = out.splitlines()
    for line, count in RUNS[name][2].items():
        assert lines.count(line) == count, f"{line!r} x{lines.count(line)}, want {count}\n{out}"


def test_the_readme_embedded_example_runs(tmp_path):
    """The README's first Python block (the embedded example) runs as written."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "Ems.init" in block and "cc.load" in block
    script = tmp_path / "readme_example.py"
    script.write_text(block)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env({}),
                         capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["CcResult(success=2, total=2)"] * 2
