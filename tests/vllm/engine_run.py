"""Run vLLM engines one after the other in THIS process, as a JSON spec says; write
what they produced as JSON. Runs inside the vLLM venv (tests/vllm/test_vllm.py starts
it as a subprocess with a timeout).

    python engine_run.py SPEC.json OUT.json

SPEC: {"engines": [{"name", "model", "connector": bool, "extra": {...},
                    "max_tokens", "steps": [{"name", "prompts": [[ids]], "kill_pid"?}]}]}
Before a step: ``kill_pid`` is SIGKILLed (the test's ems-server), ``pause_pid`` /
``resume_pid`` SIGSTOPped / SIGCONTed (a hung pool), ``hang_before_load_pid``
SIGSTOPped between the lookup and the load of the step (SIGCONTed after), ``wait_file`` is
waited for (at most ``wait_s``, default 60 s), then ``sleep_s`` slept; after it,
``signal_file`` is written (how the test restarts the pool between two steps).
OUT: per engine, per step: the greedy tokens and ``num_cached_tokens`` of every
prompt, and the connector's statistics once its saves are done (``connector_stats``:
the scheduler's in single-process mode only).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import sys
import time


def _flush_worker(_worker=None) -> dict:
    """In a worker (its own process in vLLM's default mode, sent there by
    ``collective_rpc``; this process in single-process mode): wait for the saves of
    the requests just served, then the connector's counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return {}
    connector = get_kv_transfer_group()
    connector.flush()
    return dataclasses.asdict(connector.statistics())


def connector_stats(llm) -> dict:
    """The connector's counters once its saves are done: ``worker`` (single-process
    mode) or ``workers`` (default mode: one per rank, through ``collective_rpc``, which
    needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to send the function), and ``scheduler``
    (single-process mode only: the engine core is another process otherwise). Waiting
    for the saves before the engine shuts down matters: vLLM's shutdown gives its
    workers 5 s, and on a loaded CPU a save still in flight may not make it."""
    out = {}
    core = in_process_core(llm)
    if core is not None:
        try:
            out["worker"] = _flush_worker()
        except Exception as exc:  # noqa: BLE001 - a report, not a check
            out["worker_error"] = repr(exc)
        try:
            if core.scheduler.connector is not None:
                out["scheduler"] = dataclasses.asdict(core.scheduler.connector.statistics())
        except Exception as exc:  # noqa: BLE001
            out["scheduler_error"] = repr(exc)
    else:
        try:
            out["workers"] = llm.collective_rpc(_flush_worker, timeout=60)
        except Exception as exc:  # noqa: BLE001
            out["workers_error"] = repr(exc)
    return out


def in_process_core(llm):
    """vLLM's engine core when it runs in this process (single-process mode), else
    None (the default mode: it is another process)."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def hang_pool_before_load(pid: int):
    """Fault injection with the real daemon: SIGSTOP it after the scheduler's lookup
    found the blocks, just before the worker's first load of this step (a pool that
    hangs between lookup and load; the load must time out and vLLM recompute)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    worker = get_kv_transfer_group()
    original = worker.start_load_kv

    def start_load_kv(forward_context, **kwargs):
        meta = worker._connector_metadata
        if getattr(meta, "loads", None):
            os.kill(pid, signal.SIGSTOP)
            worker.start_load_kv = original  # once
        return original(forward_context, **kwargs)

    worker.start_load_kv = start_load_kv

    def undo():
        worker.start_load_kv = original
        os.kill(pid, signal.SIGCONT)
    return undo


def skip_group_after_load(kind: str):
    """The negative control of a hybrid model: after every load, zero the pages just
    loaded of the KV cache group whose spec is ``kind`` (e.g. SlidingWindowSpec): what
    a connector that skipped that group would leave, so the test sees that a skipped
    group changes the outputs."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from ems.integrations.kv_layout import NULL_BLOCK
    worker = get_kv_transfer_group()
    group = [type(spec).__name__ for spec in worker.worker.groups.specs].index(kind)
    original = worker.start_load_kv

    def start_load_kv(forward_context, **kwargs):
        meta = worker._connector_metadata
        original(forward_context, **kwargs)
        layers = worker._session._layout[0]
        for t in getattr(meta, "loads", ()):
            ids = [b for b in t.block_ids[group] if b != NULL_BLOCK]
            for li in worker.worker.groups.layer_groups()[group]:
                for tensor in layers[li]:
                    tensor[torch.tensor(ids, dtype=torch.long)] = 0

    worker.start_load_kv = start_load_kv


class VllmEvents:
    """vLLM's own KV events of this engine (``"vllm_events": true``: its ZMQ publisher
    on a free localhost port, a subscriber thread here): the block hashes vLLM
    published as stored, per KV cache group. And the hashes the connector handed the
    pool with its saves (its ``event_hashes``), to compare."""

    def __init__(self) -> None:
        import socket
        import threading

        import zmq
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.stored: dict = {}  # group_idx -> [hash, ...]
        self.ems: list = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def config(self):
        from vllm.config import KVEventsConfig
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=self.endpoint.replace("127.0.0.1", "*"))

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import BlockStored, KVEventBatch
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if self._sub.poll(100):
                _, _, payload = self._sub.recv_multipart()
                for event in decoder.decode(payload).events:
                    if isinstance(event, BlockStored):
                        self.stored.setdefault(event.group_idx or 0, []).extend(
                            event.block_hashes)

    def spy_saves(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        session = get_kv_transfer_group()._session
        original = session.save

        def save(hashes, chunk_descs, event_hashes=None, **options):
            self.ems.extend(event_hashes or ())
            return original(hashes, chunk_descs, event_hashes, **options)
        session.save = save

    def close(self) -> dict:
        time.sleep(1.0)  # the last batches
        self._stop.set()
        self._thread.join()
        self._sub.close(0)
        self._ctx.term()
        return {"vllm_stored": {str(k): v for k, v in self.stored.items()},
                "ems_event_hashes": self.ems}


def kv_cache_groups(llm) -> list:
    """The engine's KV cache groups (their spec kinds); single-process mode only."""
    core = in_process_core(llm)
    if core is None:
        return []
    try:
        config = core.scheduler.kv_cache_config
        return [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
    except AttributeError:
        return []


def run_engine(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    events = VllmEvents() if spec.get("vllm_events") else None
    if events is not None:
        kwargs["kv_events_config"] = events.config()
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="EmsConnector", kv_connector_module_path="ems.integrations.vllm",
            kv_role=spec.get("kv_role", "kv_both"), kv_connector_extra_config=spec.get("extra", {}))
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True,
              max_model_len=spec.get("max_model_len", 2048), block_size=spec.get("block_size", 32),
              enable_prefix_caching=True, seed=0,
              kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
              skip_tokenizer_init=True, max_num_batched_tokens=spec.get("max_batched", 2048),
              tensor_parallel_size=spec.get("tp", 1),
              prefix_caching_hash_algo=spec.get("hash_algo", "sha256"),
              # "hybrid": the hybrid KV cache manager must be on (vLLM fails at start
              # where it cannot); default: vLLM's choice
              disable_hybrid_kv_cache_manager=False if spec.get("hybrid") else None,
              **kwargs)
    result = {"name": spec["name"], "start_s": round(time.perf_counter() - t0, 2),
              "steps": [], "kv_cache_groups": kv_cache_groups(llm)}
    if events is not None:
        events.spy_saves()
    if spec.get("skip_group_after_load") is not None:
        skip_group_after_load(spec["skip_group_after_load"])
    sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8),
                        detokenize=False, ignore_eos=True)
    for step in spec["steps"]:
        for key, sig in (("kill_pid", signal.SIGKILL), ("pause_pid", signal.SIGSTOP),
                         ("resume_pid", signal.SIGCONT)):
            if step.get(key):
                os.kill(int(step[key]), sig)
        if step.get("wait_file"):
            deadline = time.monotonic() + step.get("wait_s", 60)
            while not os.path.exists(step["wait_file"]):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{step['wait_file']} did not appear")
                time.sleep(0.05)
        time.sleep(step.get("sleep_s", 0))
        undo = hang_pool_before_load(int(step["hang_before_load_pid"])) \
            if step.get("hang_before_load_pid") else None
        t1 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], sp,
                            use_tqdm=False) if step["prompts"] else []
        result["steps"].append({
            "name": step["name"], "s": round(time.perf_counter() - t1, 3),
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "stats": connector_stats(llm)})
        if undo is not None:
            undo()
        if step.get("signal_file"):
            with open(step["signal_file"], "w") as f:
                f.write("done")
    result["stats"] = connector_stats(llm)
    if events is not None:
        result["events"] = events.close()
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()
    return result


def show_ems_logs() -> None:
    """ems logs under "ems" (a library configures no handlers): show them in this log.
    Called on import, so that vLLM's engine-core and worker processes (default mode),
    which import this module again as their main, log too."""
    import logging
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"EMS %(levelname)s pid={os.getpid()} %(name)s: %(message)s"))
    logging.getLogger("ems").addHandler(handler)
    logging.getLogger("ems").setLevel(logging.INFO)


show_ems_logs()


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    results = [run_engine(e) for e in spec["engines"]]
    with open(out_path + ".tmp", "w") as f:
        json.dump({"engines": results}, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
