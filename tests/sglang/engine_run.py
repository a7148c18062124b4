"""Run SGLang engines one after the other, as a JSON spec says; write what they produced
as JSON. Runs inside the SGLang venv (tests/sglang/test_sglang.py and
benchmarks/sglang_ttft.py start it as a subprocess with a timeout), with
``tests/sglang/shim`` on ``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``.

    python engine_run.py SPEC.json OUT.json

SPEC: {"engines": [{"name", "model", "storage": null | "ems" | "file",
                    "extra": {...}, "args": {...}, "max_new_tokens",
                    "steps": [{"name", "prompts": [[ids]], ...}]}]}
``storage`` "ems": HiCache with ``EmsStorage`` through SGLang's ``dynamic`` factory
(``extra``: more keys of its extra config); "file": HiCache with SGLang's own ``file``
backend (``extra``: its extra config); null: no L3 (``hicache`` true: HiCache without
L3). ``args``: more ``sgl.Engine`` arguments.
Before a step: ``kill_pid`` is SIGKILLed (the test's ems-server), ``wait_file`` waited
for (how the test says it restarted the pool), then ``sleep_s`` slept; ``flush``
empties the engine's device and host caches (``flush_cache``: L3 keeps its pages, and
SGLang restarts its storage threads), so the step's prompts find their prefix only in
L3 as a fresh engine would. After it,
``signal_file`` is written, with ``wait_pool`` ({"socket", "objects", "tenant", "timeout_s"}),
wait until the daemon holds at least ``objects`` objects for the tenant (the
backups to L3 are asynchronous); ``wait_files`` ({"dir", "count"}) the same for
SGLang's ``file`` backend; then ``poison`` ({"prompt", "model_id"}) stores random
bytes under the ems keys of that prompt's full pages (the negative control's wrong KV;
one object of the size of the pages stored so far each). Each prompt is sent alone;
with ``max_new_tokens`` 1 its time is the time to first token.
OUT: per engine, per step: the greedy tokens, ``cached_tokens`` and
``cached_tokens_details`` of every prompt, each prompt's seconds, and ``openmp``: the
scheduler process's OpenMP workers after the step (``ems.testing.openmp``: ``workers``,
``cpus``, ``throttled``; ``torch_threads`` is this process's, which the scheduler
inherits on a CPU device) and the host's 1-minute load average.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

PAGE = 16


def engine_args(spec: dict) -> dict:
    args = dict(model_path=spec["model"], device="cpu", attention_backend="torch_native",
                skip_tokenizer_init=True, dtype="bfloat16", mem_fraction_static=0.05,
                max_total_tokens=spec.get("max_total_tokens", 4096), disable_cuda_graph=True,
                page_size=PAGE, random_seed=0, log_level="warning")
    storage = spec.get("storage")
    if storage or spec.get("hicache"):
        args.update(enable_hierarchical_cache=True, hicache_ratio=2.0,
                    hicache_io_backend="direct",
                    hicache_mem_layout=spec.get("layout", "page_first_direct"),
                    hicache_write_policy="write_through",
                    hicache_storage_prefetch_policy="wait_complete")
    if storage == "ems":
        extra = {"backend_name": "ems", "module_path": "ems.integrations.sglang",
                 "class_name": "EmsStorage", "interface_v1": 1}
        extra.update(spec.get("extra", {}))
        args.update(hicache_storage_backend="dynamic",
                    hicache_storage_backend_extra_config=json.dumps(extra))
    elif storage == "file":
        args.update(hicache_storage_backend="file")
        if spec.get("extra"):
            args.update(hicache_storage_backend_extra_config=json.dumps(spec["extra"]))
    args.update(spec.get("args", {}))
    return args


def wait_pool(cond: dict) -> dict:
    from ems.client.remote import server_report

    deadline = time.monotonic() + cond.get("timeout_s", 60)
    tenant = cond.get("tenant") or "(anonymous)"
    row: dict = {}
    while time.monotonic() < deadline:
        row = server_report(cond["socket"])["tenants"].get(tenant, {})
        if row.get("objects", 0) >= cond["objects"]:
            return row
        time.sleep(0.2)
    raise SystemExit(f"the pool holds {row.get('objects')} objects of {tenant}, "
                     f"expected {cond['objects']}")


def poison(cond: dict, pool_row: dict, layout: str) -> int:
    import torch
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from ems import CcConfig, CcKvOption, Ems, EmsConfig, KvBufferWrapper
    from ems.integrations.hicache import KV_POOL, EngineRank, PageKeys

    page_bytes = pool_row["stored_bytes"] // pool_row["objects"]
    tokens = cond["prompt"][:len(cond["prompt"]) // PAGE * PAGE]
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    keys = PageKeys.of(EngineRank(), cond["model_id"])
    page_format = f"{layout}/torch.bfloat16/{PAGE}"  # the host pool's (engine_args)
    values = torch.randn(len(hashes), page_bytes // 2).to(torch.bfloat16)
    Ems.init(EmsConfig(access_id=os.environ.get("EMS_ACCESS_ID"),
                       access_key=os.environ.get("EMS_ACCESS_KEY"),
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="poison")))
    try:
        return Ems.get_cc().save(
            CcKvOption(timeout=5000), [keys.key(h, KV_POOL, page_format) for h in hashes],
            [[KvBufferWrapper(v.data_ptr(), page_bytes)] for v in values]).success
    finally:
        Ems.finalize()


def wait_files(cond: dict) -> int:
    deadline = time.monotonic() + cond.get("timeout_s", 120)
    n = 0
    while time.monotonic() < deadline:
        n = sum(1 for f in os.listdir(cond["dir"]) if f.endswith(".bin"))
        if n >= cond["count"]:
            return n
        time.sleep(0.2)
    raise SystemExit(f"{cond['dir']} holds {n} pages, expected {cond['count']}")


def scheduler_pids() -> set[int]:
    """Our children that SGLang names ``sglang::scheduler`` (a stopped engine's may
    linger a moment while it exits)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if comm.startswith("sglang::schedul") and int(rest.split()[1]) == os.getpid():
            pids.add(int(entry))
    return pids


def openmp_row(pid: int) -> dict:
    import torch

    from ems.testing.openmp import openmp_threads

    t = openmp_threads(pid)
    return {"workers": t.workers, "cpus": t.cpus, "throttled": t.throttled,
            "torch_threads": torch.get_num_threads()}


def flush(engine) -> None:
    """``flush_cache``, retried while SGLang refuses it (a request or a write still in
    flight): bounded."""
    deadline = time.monotonic() + 60
    while True:
        r = engine.flush_cache()
        if r.success:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"flush_cache refused for 60 s: {r}")
        time.sleep(0.5)


def run_engine(spec: dict) -> dict:
    import sglang as sgl

    before = scheduler_pids()
    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_args(spec))
    result = {"name": spec["name"], "start_s": round(time.perf_counter() - t0, 2),
              "steps": []}
    new = scheduler_pids() - before
    if len(new) != 1:
        raise SystemExit(f"expected one new sglang::scheduler child, found {sorted(new)}")
    scheduler = new.pop()
    sampling = {"temperature": 0.0, "max_new_tokens": spec.get("max_new_tokens", 8),
                "ignore_eos": True}
    try:
        for step in spec["steps"]:
            if step.get("kill_pid"):
                os.kill(int(step["kill_pid"]), signal.SIGKILL)
            if step.get("wait_file"):
                deadline = time.monotonic() + 60
                while not os.path.exists(step["wait_file"]):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{step['wait_file']} did not appear")
                    time.sleep(0.05)
            time.sleep(step.get("sleep_s", 0))
            if step.get("flush"):
                flush(engine)
            out = {"name": step["name"], "tokens": [], "cached": [], "details": [], "s": []}
            for prompt in step["prompts"]:
                t1 = time.perf_counter()
                r = engine.generate(input_ids=prompt, sampling_params=sampling)
                out["s"].append(round(time.perf_counter() - t1, 4))
                meta = r["meta_info"]
                out["tokens"].append(list(r["output_ids"]))
                out["cached"].append(meta.get("cached_tokens", 0))
                out["details"].append(meta.get("cached_tokens_details") or {})
            if step.get("signal_file"):
                with open(step["signal_file"], "w") as f:
                    f.write("done")
            if step.get("wait_pool"):
                out["pool"] = wait_pool(step["wait_pool"])
            if step.get("poison"):
                out["poisoned"] = poison(step["poison"], out["pool"],
                                         spec.get("layout", "page_first_direct"))
            if step.get("wait_files"):
                out["files"] = wait_files(step["wait_files"])
            out["openmp"] = openmp_row(scheduler)
            out["loadavg_1m"] = os.getloadavg()[0]
            result["steps"].append(out)
    finally:
        engine.shutdown()
    return result


def main() -> None:
    import logging

    # ems logs under "ems" (a library configures no handlers); the engine's scheduler
    # processes inherit nothing of this, so they log through SGLang's own handlers
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("EMS %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("ems").addHandler(handler)
    logging.getLogger("ems").setLevel(logging.INFO)
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    results = []
    for e in spec["engines"]:
        results.append(run_engine(e))
        with open(out_path + ".tmp", "w") as f:  # what ran so far, for a failing test
            json.dump({"engines": results}, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
