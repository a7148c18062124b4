"""End to end on a real SGLang (0.5.23 on a CPU torch, in its own venv): ems as the L3
storage of SGLang's HiCache, loaded by SGLang's ``dynamic`` backend factory.

The module fixture builds (or reuses) the venv with ``scripts/sglang-venv.sh`` (it
skips with the script's one ``SKIP:`` line where the local CPU torch wheel is
missing), builds two tiny Llamas with random fixed-seed weights (same architecture,
other seeds), starts a real ``ems-server`` with two tenants, and runs one engine script
(``engine_run.py``) in the venv as a subprocess with a timeout, killed by its process
group on failure. Its engines, one after the other (each a fresh SGLang scheduler
process, so a fresh ``EmsStorage``; pages of 16 tokens, a 512-token shared prefix):

1. ``store`` (tenant A): computes three prompts (their outputs are the references: no
   L3 data existed); their pages are backed up to ems, one pool object per page (the
   script waits for them: backups are asynchronous). Then random bytes are stored under
   the keys of a fourth prompt's pages (``poison``);
2. ``other-tenant`` (tenant B, credentials in the extra config, host layout
   ``layer_first`` where the others use ``page_first_direct``, the OpenMP warm-up off):
   the shared prefix and the poisoned prefix are NOT found (tenant A's pages are not
   its pages); its outputs are the references of those two prompts;
3. ``load`` (tenant A, fresh): the shared prefix comes from storage
   (``cached_tokens_details["storage"]``) with the reference output; the poisoned
   prefix also comes from storage and the output changes (the negative control: the
   loaded KV is really used); its scheduler holds an OpenMP team per storage thread
   (the warm-up op) and is in libgomp's throttled wait regime, tenant B's is not; the
   pool is SIGKILLed and a new prompt is served (reference output, no hang); the pool
   is restarted and the engine stores into it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from ems.testing import run_server

pytestmark = [pytest.mark.sglang, pytest.mark.engine, pytest.mark.timeout(1500)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 16
PREFIX_PAGES = 32  # the shared prefix: 512 tokens (SGLang prefetches hits >= 256)
SKIP_RC = 3
TENANTS = {"tenant-a": "a" * 32, "tenant-b": "b" * 32}


def _run(cmd: list[str], env: dict, timeout_s: float, log_path: str) -> int:
    """Run ``cmd`` in its own process group; on timeout kill that group (by its PID)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


#: where SGLang's engines leave what they do not remove: a shared memory file of its
#: scheduler's loads (``sglang_loads_*``, 16 KiB) and multiprocessing semaphores
#: (``sem.mp-*``) per engine, three of each per run of this module, accumulating in
#: memory from run to run
SHM_DIR = "/dev/shm"
_LEFT_BEHIND = ("sglang_", "sem.mp-")


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _remove_left_behind(before: set[str]) -> None:
    """Once the engines' processes are gone: remove what they left in ``SHM_DIR`` since
    ``before`` (the names SGLang's engines leave; nothing else is touched)."""
    for name in _shm_names() - before:
        if name.startswith(_LEFT_BEHIND):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))


def _tail(path: str, n: int = 80) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def sglang_env(tmp: str) -> dict[str, str]:
    """The environment of an engine script: the harness's shims on the path, caches
    under ``tmp``, no ems settings of the caller's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EMS_", "SGLANG_", "PYTHON"))}
    env.update(PYTHONPATH=os.path.join(HERE, "shim"), SGLANG_USE_CPU_ENGINE="1",
               TMPDIR=tmp, XDG_CACHE_HOME=os.path.join(tmp, "cache"),
               SGLANG_CACHE_DIR=os.path.join(tmp, "cache", "sglang"),
               TORCH_EXTENSIONS_DIR=os.path.join(tmp, "cache", "torch"),
               EMS_CONNECT_TIMEOUT_MS="1000")
    return env


def build_venv() -> str:
    """The SGLang venv's python (skips the calling test where it cannot be built)."""
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "sglang-venv.sh")],
                       capture_output=True, text=True, timeout=1200)
    if r.returncode == SKIP_RC:
        pytest.skip(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, f"sglang-venv.sh failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def venv_python() -> str:
    return build_venv()


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(22)
    tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    prefix = tok(PREFIX_PAGES * PAGE)
    return {"store": prefix + tok(37), "hit": prefix + tok(21), "after_kill": tok(300),
            "after_restart": tok(290), "poison": tok(PREFIX_PAGES * PAGE) + tok(21)}


MODEL_ID = "tiny-llama"  # the keys' model (the poison step computes them)
STORED = ("store", "after_kill", "after_restart")


@pytest.fixture(scope="module")
def runs(venv_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = str(tmp_path_factory.mktemp("sglang-e2e"))
    log = os.path.join(tmp, "engines.log")
    env = sglang_env(tmp)
    model = os.path.join(tmp, "llama")
    rc = _run([venv_python, os.path.join(REPO, "tests", "vllm", "make_model.py"), model],
              env, 300, log)
    assert rc == 0, _tail(log)
    p = _prompts()
    killed, restarted = os.path.join(tmp, "killed"), os.path.join(tmp, "restarted")
    os.makedirs(os.path.join(tmp, "pool"))
    with run_server(os.path.join(tmp, "pool"), capacity="256M", tenants=TENANTS,
                    anonymous=False) as server:
        env.update(server.client_env(), EMS_ACCESS_ID="tenant-a",
                   EMS_ACCESS_KEY=TENANTS["tenant-a"])
        sock = server.socket_path
        # the pool is picked up again within 0.5 s of coming back
        extra = {"model_id": MODEL_ID, "health_interval_s": 0.5}

        def pool_wait(n: int, tenant: str = "tenant-a") -> dict:
            return {"socket": sock, "objects": n, "tenant": tenant, "timeout_s": 120}

        stored_pages = sum(len(p[k]) // PAGE for k in STORED)
        specs = [
            {"name": "store", "model": model, "storage": "ems", "extra": extra,
             "steps": [{"name": "store", "prompts": [p[k] for k in STORED],
                        "wait_pool": pool_wait(stored_pages),
                        "poison": {"prompt": p["poison"], "model_id": MODEL_ID}}]},
            # (and SGLang's other host layout: its pages are K and V of each layer)
            {"name": "other-tenant", "model": model, "storage": "ems", "layout": "layer_first",
             "extra": dict(extra, access_id="tenant-b", access_key=TENANTS["tenant-b"],
                           openmp_warmup=False),
             "steps": [{"name": "refs", "prompts": [p["hit"], p["poison"]],
                        "wait_pool": pool_wait(PREFIX_PAGES, "tenant-b")}]},
            {"name": "load", "model": model, "storage": "ems", "extra": extra,
             "steps": [{"name": "hit", "prompts": [p["hit"]]},
                       {"name": "poisoned", "prompts": [p["poison"]]},
                       {"name": "after_kill", "prompts": [p["after_kill"]],
                        "kill_pid": server.pid, "signal_file": killed},
                       {"name": "after_restart", "prompts": [p["after_restart"]],
                        "wait_file": restarted, "sleep_s": 2.0,
                        "wait_pool": pool_wait(1)}]},
        ]
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"engines": specs}, f)
        t0 = time.monotonic()
        shm_before = _shm_names()
        with open(log, "ab") as logf:
            proc = subprocess.Popen(
                [venv_python, os.path.join(HERE, "engine_run.py"), spec_path, out_path],
                env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        try:
            deadline = t0 + 780
            while not os.path.exists(killed):
                assert proc.poll() is None, f"engines exited {proc.returncode}:\n{_tail(log)}"
                assert time.monotonic() < deadline, "the engines did not reach the kill step"
                time.sleep(0.1)
            assert not server.running, "the engine script did not kill the pool"
            server.stop()  # reaps the killed daemon
            server.start()
            with open(restarted, "w") as f:
                f.write("go")
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"engines exited {rc}:\n{_tail(log)}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            _remove_left_behind(shm_before)
        with open(out_path) as f:
            engines = {e["name"]: e for e in json.load(f)["engines"]}
    with open(log, errors="replace") as f:
        engines["log_text"] = f.read()
    engines["prompts"] = p
    sys.stderr.write(f"sglang e2e: {time.monotonic() - t0:.0f} s of engines\n")
    return engines


def test_backend_against_sglangs_classes(venv_python: str, tmp_path) -> None:
    """backend_check.py: the v1 and v2 paths, MLA, the older forms, get_stats, a
    hung pool, a refused key and the pool down at start, on SGLang's real classes (no
    engine)."""
    os.makedirs(tmp_path / "pool")
    with run_server(str(tmp_path / "pool"), capacity="64M") as server:
        env = sglang_env(str(tmp_path))
        r = subprocess.run([venv_python, os.path.join(HERE, "backend_check.py"),
                            server.socket_dir, str(tmp_path / "no-daemon"),
                            str(server.pid)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout + r.stderr[-3000:]


def _step(runs: dict, engine: str, name: str) -> dict:
    return next(s for s in runs[engine]["steps"] if s["name"] == name)


def _ref(runs: dict, prompt: str) -> list[int]:
    """The greedy output of ``prompt`` computed without L3 data (storage 0)."""
    if prompt in STORED:
        step, i = _step(runs, "store", "store"), STORED.index(prompt)
    else:
        step, i = _step(runs, "other-tenant", "refs"), ("hit", "poison").index(prompt)
    assert step["details"][i].get("storage", 0) == 0, step["details"][i]
    return step["tokens"][i]


def test_a_fresh_engine_loads_the_prefix_from_ems(runs: dict) -> None:
    hit = _step(runs, "load", "hit")
    details = hit["details"][0]
    assert details.get("storage_backend") == "EmsStorage", details
    assert details["storage"] >= 0.9 * PREFIX_PAGES * PAGE, details
    assert details["storage"] % PAGE == 0, details
    assert hit["tokens"][0] == _ref(runs, "hit")  # greedy output as without L3


def test_one_pool_object_per_page(runs: dict) -> None:
    pool = _step(runs, "store", "store")["pool"]
    prompts = [runs["prompts"][k] for k in STORED]
    # every full page of the prompts (K and V of every layer: one object); at most
    # the pages their 8 output tokens complete
    assert sum(len(q) // PAGE for q in prompts) <= pool["objects"] \
        <= sum((len(q) + 8) // PAGE for q in prompts), pool


def test_loaded_kv_is_used_negative_control(runs: dict) -> None:
    """Random bytes stored under a prompt's keys are loaded and change the output: the
    output comes from the loaded KV, not from a recomputation."""
    assert _step(runs, "store", "store")["poisoned"] == len(runs["prompts"]["poison"]) // PAGE
    bad = _step(runs, "load", "poisoned")
    assert bad["details"][0]["storage"] >= 0.9 * PREFIX_PAGES * PAGE, bad["details"]
    assert bad["tokens"][0] != _ref(runs, "poison")


def test_tenants_never_share_pages(runs: dict) -> None:
    refs = _step(runs, "other-tenant", "refs")
    # tenant A holds pages of both prompts; tenant B finds none of them
    assert [d.get("storage", 0) for d in refs["details"]] == [0, 0], refs["details"]
    assert refs["pool"]["objects"] >= PREFIX_PAGES  # it stored its own


def test_the_scheduler_is_in_openmps_throttled_regime(runs: dict) -> None:
    """The OpenMP warm-up op (``ems.integrations.openmp``): each SGLang storage thread
    that called the backend holds an OpenMP team, so the scheduler process has more
    OpenMP-managed threads than CPUs and its forward's barriers spin 100 iterations,
    not 300,000, before they sleep (as SGLang's ``file`` backend gets by its torch ops
    on its prefetch thread). The negative control: tenant B's engine, warm-up off,
    holds only its forward's team and stays below the line (ems's copies are C code)."""
    on = _step(runs, "load", "poisoned")["openmp"]  # after the hit and its backup
    off = _step(runs, "other-tenant", "refs")["openmp"]
    team = on["torch_threads"]
    if team < 2:
        pytest.skip(f"torch runs {team} thread here: OpenMP starts no team at all")
    # the hits ran batch_exists (prefetch thread), batch_get_v1 (prefetch I/O thread)
    # and their tails' batch_set_v1 (backup thread): three teams of team - 1 workers
    assert on["workers"] >= off["workers"] + 3 * (team - 1), (on, off)
    if team == on["cpus"]:  # the default: torch runs one thread per CPU
        assert on["throttled"] and not off["throttled"], (on, off)


def test_pool_killed_then_restarted(runs: dict) -> None:
    after_kill = _step(runs, "load", "after_kill")
    assert after_kill["tokens"][0] == _ref(runs, "after_kill")
    assert after_kill["s"][0] < 30, after_kill  # served within the deadlines, no hang
    after_restart = _step(runs, "load", "after_restart")
    assert after_restart["tokens"][0] == _ref(runs, "after_restart")
    assert after_restart["pool"]["objects"] >= 1  # picked up again: it stores
    warnings = [ln for ln in runs["log_text"].splitlines()
                if "the pool is unavailable" in ln]
    assert 1 <= len(warnings) <= 2, warnings  # one warning per outage
