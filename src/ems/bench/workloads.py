"""The workloads: V0 batches, V1 registered layout, 1-key latency, multi-process
scaling, and filling a pool past its capacity.

Every workload runs the systems side by side, rotating their order each repetition
so that a noisy neighbour hurts all of them alike; the first repetition of each case
is an untimed warm-up that also checks the bytes came back right. A system that fails
is reported with the reason and leaves that workload; the run goes on.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ems.bench.systems import (
    LIMITS,
    BenchError,
    EmsDaemon,
    EmsSystem,
    LimitSystem,
    MemcpySystem,
    MooncakeSystem,
    RedisSystem,
    System,
    touched,
)
from ems.progress import Progress

__all__ = ["Params", "Row", "Latency", "Context", "WORKLOADS", "steps"]

KiB, MiB = 1 << 10, 1 << 20


@dataclasses.dataclass(frozen=True)
class Params:
    """Sizes and repetitions of one run (``quick`` or full)."""

    v0_cases: tuple[tuple[int, int], ...]  # (value_bytes, keys per batch)
    reps: int
    capacity_bytes: int  # of each pool (ems, Mooncake) and of memcpy's store
    v1_cases: tuple[tuple[int, int], ...]  # (block_size tokens, prefix tokens)
    v1_layers: int
    latency_ops: int
    scaling_procs: tuple[int, ...]
    scaling_batch: tuple[int, int]
    fill_capacity_bytes: int
    fill_batch: tuple[int, int]

    @classmethod
    def full(cls) -> "Params":
        return cls(v0_cases=((256 * KiB, 256), (1 * MiB, 256), (4 * MiB, 64)), reps=9,
                   capacity_bytes=1024 * MiB, v1_cases=((16, 4096), (128, 4096)),
                   v1_layers=32, latency_ops=2000, scaling_procs=(1, 2, 4),
                   scaling_batch=(1 * MiB, 64), fill_capacity_bytes=512 * MiB,
                   fill_batch=(1 * MiB, 32))

    @classmethod
    def quick(cls) -> "Params":
        return cls(v0_cases=((256 * KiB, 64), (1 * MiB, 64), (4 * MiB, 16)), reps=3,
                   capacity_bytes=256 * MiB, v1_cases=((16, 1024),), v1_layers=32,
                   latency_ops=300, scaling_procs=(1, 2, 4), scaling_batch=(1 * MiB, 16),
                   fill_capacity_bytes=128 * MiB, fill_batch=(1 * MiB, 16))


@dataclasses.dataclass
class Row:
    """One throughput measurement: ``bytes`` moved per repetition, each rep's seconds."""

    workload: str
    case: str
    system: str
    op: str
    bytes: int
    seconds: list[float]
    value_bytes: Optional[int] = None
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / float(np.median(self.seconds)) / 1e9 if self.seconds else 0.0

    @property
    def gbps_best(self) -> float:
        return self.bytes / min(self.seconds) / 1e9 if self.seconds else 0.0


@dataclasses.dataclass
class Latency:
    """One-key round trips of one system and op, in microseconds (sorted)."""

    system: str
    op: str
    value_bytes: int
    us: list[float]

    def pct(self, q: float) -> float:
        return float(np.percentile(self.us, q)) if self.us else float("nan")


@dataclasses.dataclass
class Context:
    params: Params
    systems: dict[str, System]  # ready systems, memcpy first
    progress: Progress
    work_dir: str
    want: set[str]  # the systems asked for (a workload may build its own instances)
    daemon: Optional[EmsDaemon] = None
    mooncake_address: Optional[str] = None
    redis_socket: Optional[str] = None
    rows: list[Row] = dataclasses.field(default_factory=list)
    latency: list[Latency] = dataclasses.field(default_factory=list)
    fill_series: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    problems: list[dict[str, str]] = dataclasses.field(default_factory=list)
    _buffers: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=dict)

    @property
    def memcpy(self) -> MemcpySystem:
        m = self.systems["memcpy"]
        assert isinstance(m, MemcpySystem)
        return m

    def problem(self, system: str, workload: str, reason: str) -> None:
        self.problems.append({"system": system, "workload": workload, "reason": reason})
        self.progress.note(f"bench: {system} / {workload}: {reason}")

    def buffers(self, system: System) -> tuple[np.ndarray, np.ndarray]:
        """Caller memory of one system: a source with a pattern, a destination."""
        # Systems that take any memory share one pair; Mooncake needs its own.
        key = system.name if type(system).alloc is not System.alloc else "numpy"
        if key not in self._buffers:
            nbytes = max_batch_bytes(self.params)
            src, dst = system.alloc(nbytes), system.alloc(nbytes)
            src.view(np.uint64)[:] = np.arange(nbytes // 8, dtype=np.uint64)
            self._buffers[key] = (src, dst)
        return self._buffers[key]

    def drop_buffers(self) -> None:
        self._buffers.clear()


def max_batch_bytes(p: Params) -> int:
    return max(size * n for size, n in p.v0_cases)


def _rows2d(flat: np.ndarray, n: int, size: int) -> np.ndarray:
    return flat[: n * size].reshape(n, size)


def _rotated(items: list, k: int) -> list:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def _timed(fn: Callable[[], None]) -> float:
    """Seconds of one call, with the garbage collector paused during it, as ``timeit``
    does: a collection's pause depends on this process's whole heap (the bench's own
    rows and latency samples, torch), not on the system timed. With it running, one
    run's 4 MiB x 64 saves took 23-30 ms in three reps and 14-17 in the next two, for
    ems on both pools alike; paused, 13-20 ms in all five."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        if enabled:
            gc.enable()


def _size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // KiB} KiB"


# ---------------------------------------------------------------------- V0
def run_v0(ctx: Context) -> None:
    p = ctx.params
    active = dict(ctx.systems)
    warmed: set[str] = set()
    for size, n in p.v0_cases:
        case = f"{_size_label(size)} x {n}"
        rows = {(name, op): Row("v0", case, name, op, size * n, [], size)
                for name in active for op in ("save", "load")}
        for rep in range(p.reps + 1):
            for name, system in _rotated(list(active.items()), rep):
                try:
                    src_flat, dst_flat = ctx.buffers(system)
                    src, dst = _rows2d(src_flat, n, size), _rows2d(dst_flat, n, size)
                    if name not in warmed:
                        system.warm(src, p.capacity_bytes)
                        warmed.add(name)
                    keys = [f"v0-{size}-{rep}-{i}" for i in range(n)]
                    system.reset()
                    if rep == 0:
                        dst.fill(0)
                    t_save = _timed(lambda: system.save(keys, src))
                    t_load = _timed(lambda: system.load(keys, dst))
                    if rep == 0:
                        if not np.array_equal(src, dst):
                            raise BenchError("loaded bytes differ from the saved ones")
                    else:
                        rows[(name, "save")].seconds.append(t_save)
                        rows[(name, "load")].seconds.append(t_load)
                except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                    ctx.problem(name, "v0", f"{type(exc).__name__}: {exc}")
                    del active[name]
                ctx.progress.step(f"v0 {case}: {name}")
        ctx.rows.extend(r for r in rows.values() if r.seconds)


def steps_v0(p: Params, n_systems: int) -> int:
    return len(p.v0_cases) * (p.reps + 1) * n_systems


# ---------------------------------------------------------------------- V1
def _v1_cache(torch: Any, layers: int, num_blocks: int, block_size: int) -> list:
    kv = []
    for li in range(layers):
        pair = []
        for ti in range(2):
            t = torch.empty((num_blocks, block_size, 8, 128), dtype=torch.float16)
            flat = t.view(-1).view(torch.int16)
            flat.copy_(torch.arange(flat.numel(), dtype=torch.int32).remainder_(30011)
                       .add_(li * 2 + ti).to(torch.int16))
            pair.append(t)
        kv.append(pair)
    return kv


def _checksum(torch: Any, kv: list, blocks: Any) -> int:
    return sum(int(t.index_select(0, blocks).view(torch.int16).sum(dtype=torch.int64))
               for pair in kv for t in pair)


def run_v1(ctx: Context) -> None:
    try:
        import torch
    except ImportError:
        ctx.problem("ems", "v1", "torch is not installed (V1 needs it)")
        return
    p = ctx.params
    ems = {k: s for k, s in ctx.systems.items() if isinstance(s, EmsSystem)}
    if not ems:
        return
    src_flat, _ = ctx.buffers(ctx.memcpy)
    for ci, (bs, tokens) in enumerate(p.v1_cases):
        n_blk = tokens // bs
        num_blocks = n_blk + n_blk // 4 + 1
        case = f"{p.v1_layers}L K,V [{bs},8,128] fp16, {tokens} tok"
        gen = torch.Generator().manual_seed(ci)
        blocks = torch.randperm(num_blocks, generator=gen)[:n_blk]
        kv = _v1_cache(torch, p.v1_layers, num_blocks, bs)
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1).tolist()
        offsets = [bs] * n_blk
        nbytes = tokens * p.v1_layers * 2 * 8 * 128 * 2
        active = dict(ems)
        for name, system in list(active.items()):
            try:
                system.cc.register_kvcache(kv)
            except Exception as exc:  # noqa: BLE001 - reported
                ctx.problem(name, "v1", f"register_kvcache: {exc}")
                del active[name]
        limits = [n for n in LIMITS if n in ctx.systems]
        names = ["memcpy", *limits, *active]
        # (the store stays referenced here while the limit rows copy into it)
        store, runs = _v1_runs(torch, kv, blocks) if limits else (None, None)
        rows = {(name, op): Row("v1", case, name, op, nbytes, [], bs * 2 * 8 * 128 * 2
                                * p.v1_layers, _V1_NOTES.get(name, ""))
                for name in names for op in ("save", "load")}
        expect = _checksum(torch, kv, blocks)
        for rep in range(p.reps + 1):
            for name in _rotated(names, rep):
                if name == "memcpy":  # numpy: one contiguous copy of as many bytes
                    base = ctx.systems[name]
                    assert isinstance(base, MemcpySystem)
                    t_save = _timed(lambda: base.copy(nbytes, src_flat))
                    t_load = _timed(lambda: base.copy(nbytes, src_flat))
                elif name in limits:  # the same runs (blocks) between the cache and a store
                    lim = ctx.systems[name]
                    assert isinstance(lim, LimitSystem) and runs is not None
                    into, cache, length = runs
                    t_save = _timed(lambda: lim.copy_runs(into, cache, length))
                    t_load = _timed(lambda: lim.copy_runs(cache, into, length))
                else:
                    if name not in active:
                        continue
                    system = active[name]
                    assert isinstance(system, EmsSystem)
                    hashes = [(rep + 1) * 10**9 + ci * 10**6 + i for i in range(n_blk)]
                    try:
                        t_save = _timed(lambda: _v1_call(system, "save", slots, hashes,
                                                         offsets))
                        if rep == 0:
                            for pair in kv:
                                for t in pair:
                                    t.index_fill_(0, blocks, 0)
                        t_load = _timed(lambda: _v1_call(system, "load", slots, hashes,
                                                         offsets))
                        if rep == 0 and _checksum(torch, kv, blocks) != expect:
                            raise BenchError("V1 load did not restore the saved blocks")
                    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                        ctx.problem(name, "v1", f"{type(exc).__name__}: {exc}")
                        del active[name]
                        ctx.progress.step(f"v1 {bs}: {name}")
                        continue
                if rep > 0:
                    rows[(name, "save")].seconds.append(t_save)
                    rows[(name, "load")].seconds.append(t_load)
                ctx.progress.step(f"v1 {bs}: {name}")
        ctx.rows.extend(r for r in rows.values() if r.seconds)
        del kv, store, runs


#: what the V1 baseline rows copy (the limit: the request's own runs; numpy: one stream)
_V1_NOTES = {"memcpy": "one contiguous copy", "copy-nt": "the request's block runs",
             "copy-glibc": "the request's block runs, a memmove each"}


def _v1_runs(torch: Any, kv: list, blocks: Any) -> tuple[np.ndarray, tuple[Any, Any, int]]:
    """The runs of the V1 case, for the limit: each block of each cache tensor (one run
    of ``block_size`` tokens) to where a pool object would hold it in a pre-faulted
    store (object ``i``, tensor ``t`` at ``i * object + t * run``): the store, and the
    runs as int64 address tensors (store, cache) in the order of the save's source
    addresses, with their length. The limit rows copy exactly these runs with no Python
    between runs: what any copy of the same bytes must do, at the best kernel's speed."""
    tensors = [t for pair in kv for t in pair]
    run = tensors[0][0].numel() * tensors[0].element_size()
    n = int(blocks.numel())
    cache = torch.stack([t.data_ptr() + blocks * (t.stride(0) * t.element_size())
                         for t in tensors], dim=1)  # [n, T]
    obj = run * len(tensors)
    store = touched(n * obj)
    dest = store.ctypes.data + torch.arange(n)[:, None] * obj + torch.arange(len(tensors)) * run
    cache, dest = cache.reshape(-1), dest.reshape(-1)
    order = torch.argsort(cache)
    return store, (dest[order].contiguous(), cache[order].contiguous(), run)


def _v1_call(system: EmsSystem, op: str, slots: list, hashes: list, offsets: list) -> None:
    r = getattr(system.cc, op)(slots, hashes, offsets, option=system.option)
    if r.success != r.total:
        raise BenchError(f"V1 {op} moved {r.success}/{r.total} blocks")


def steps_v1(p: Params, n_ems: int) -> int:
    return len(p.v1_cases) * (p.reps + 1) * (n_ems + 1) if n_ems else 0


# ---------------------------------------------------------------------- latency
LATENCY_BYTES = 4 * KiB


def run_latency(ctx: Context) -> None:
    p = ctx.params
    order = ["ems-daemon", "ems-embedded", "mooncake", "redis", "memcpy"]
    chunk = max(1, p.latency_ops // 4)
    for name in [n for n in order if n in ctx.systems]:
        system = ctx.systems[name]
        res = {op: Latency(name, op, LATENCY_BYTES, []) for op in ("save", "load")}
        try:
            buf = system.alloc(2 * LATENCY_BYTES)
            buf[:LATENCY_BYTES] = 7
            src = buf[:LATENCY_BYTES].reshape(1, -1)
            dst = buf[LATENCY_BYTES:].reshape(1, -1)
            system.reset()
            warm = 50
            for op, call, data in (("save", system.save, src), ("load", system.load, dst)):
                for i in range(warm + p.latency_ops):
                    keys = [f"lat-{i}"]
                    t0 = time.perf_counter_ns()
                    call(keys, data)
                    dt = time.perf_counter_ns() - t0
                    if i >= warm:
                        res[op].us.append(dt / 1e3)
                    if op == "save" and i % chunk == 0:
                        ctx.progress.step(f"latency: {name}", 0)
            if not np.array_equal(src, dst):
                raise BenchError("a 4 KiB load returned other bytes")
            for lat in res.values():
                lat.us.sort()
                ctx.latency.append(lat)
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            ctx.problem(name, "latency", f"{type(exc).__name__}: {exc}")
        ctx.progress.step(f"latency: {name}")


def steps_latency(n_systems: int) -> int:
    return n_systems


# ---------------------------------------------------------------------- scaling
def _build(spec: dict[str, Any]) -> System:
    kind = spec["system"]
    if kind == "memcpy":
        return MemcpySystem(spec["nbytes"])
    if kind == "ems-daemon":
        return EmsSystem("daemon", spec["capacity"], socket_dir=spec["socket_dir"])
    if kind == "mooncake":
        return MooncakeSystem(spec["address"], spec["mem_pool"])
    if kind == "redis":
        return RedisSystem(spec["socket"])
    raise ValueError(kind)


def scaling_worker(spec: dict[str, Any], index: int, n: int, size: int, reps: int,
                   barrier: Any, queue: Any) -> None:
    """One client process of the scaling workload (spawned; top level so it pickles)."""
    system: Optional[System] = None
    try:
        system = _build(spec)
        src, dst = system.alloc(n * size), system.alloc(n * size)
        src.view(np.uint64)[:] = np.arange(src.size // 8, dtype=np.uint64) + index
        s2, d2 = src.reshape(n, size), dst.reshape(n, size)
        if spec.get("warm"):  # map the whole pool in this process first (steady state)
            system.warm(s2, spec["capacity"])
        times = []
        for rep in range(reps + 1):
            keys = [f"sc-{spec['tag']}-{index}-{rep}-{i}" for i in range(n)]
            barrier.wait()
            t0 = time.perf_counter()
            system.save(keys, s2)
            t1 = time.perf_counter()
            barrier.wait()
            t2 = time.perf_counter()
            system.load(keys, d2)
            t3 = time.perf_counter()
            barrier.wait()
            if rep == 0:
                if not np.array_equal(s2, d2):
                    raise BenchError("loaded bytes differ")
            else:
                times.append((t0, t1, t2, t3))
            remove = getattr(system, "remove", None)
            if remove is not None:
                remove(keys)
        queue.put((index, times, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        try:
            barrier.abort()
        finally:
            queue.put((index, None, f"{type(exc).__name__}: {exc}"))
    finally:
        if system is not None:
            system.close()


def _scaling_specs(ctx: Context) -> list[dict[str, Any]]:
    n, size = ctx.params.scaling_batch
    specs: list[dict[str, Any]] = [{"system": "memcpy", "nbytes": n * size}]
    if "ems-daemon" in ctx.systems and ctx.daemon is not None:
        specs.append({"system": "ems-daemon", "socket_dir": ctx.daemon.socket_dir,
                      "capacity": ctx.daemon.capacity_bytes, "warm": True})
    if "mooncake" in ctx.systems and ctx.mooncake_address:
        specs.append({"system": "mooncake", "address": ctx.mooncake_address,
                      "mem_pool": 2 * n * size + 16 * MiB})
    if "redis" in ctx.systems and ctx.redis_socket:
        specs.append({"system": "redis", "socket": ctx.redis_socket})
    return specs


def run_scaling(ctx: Context) -> None:
    p = ctx.params
    size, n = p.scaling_batch
    if "ems-daemon" not in ctx.systems:
        ctx.problem("ems-daemon", "scaling", "needs the daemon (not running in this run)")
    mpc = mp.get_context("spawn")
    for spec in _scaling_specs(ctx):
        name = spec["system"]
        if name != "memcpy":
            reset = getattr(ctx.systems.get(name), "reset", None)
            if reset is not None:
                reset()
        for procs in p.scaling_procs:
            spec = dict(spec, tag=f"{procs}")
            case = f"{procs} proc x {_size_label(size)} x {n}"
            try:
                times = _run_workers(mpc, spec, procs, n, size, p.reps)
            except (BenchError, RuntimeError) as exc:
                ctx.problem(name, "scaling", f"{procs} processes: {exc}")
                ctx.progress.step(f"scaling: {name}", len(p.scaling_procs))
                break
            total = procs * n * size
            for op, (a, b) in (("save", (0, 1)), ("load", (2, 3))):
                secs = [max(t[rep][b] for t in times) - min(t[rep][a] for t in times)
                        for rep in range(p.reps)]
                ctx.rows.append(Row("scaling", case, name, op, total, secs, size,
                                    note=f"{procs} client processes"))
            ctx.progress.step(f"scaling: {name} x{procs}")


def _run_workers(mpc: Any, spec: dict[str, Any], procs: int, n: int, size: int,
                 reps: int) -> list[list[tuple[float, float, float, float]]]:
    barrier = mpc.Barrier(procs, timeout=120)
    queue = mpc.Queue()
    workers = [mpc.Process(target=scaling_worker, args=(spec, i, n, size, reps, barrier,
                                                        queue), daemon=True)
               for i in range(procs)]
    try:
        for w in workers:
            w.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + 300
        while len(out) < procs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("workers did not finish in 300 s")
            try:
                index, times, err = queue.get(timeout=min(left, 5.0))
            except Exception:  # noqa: BLE001 - queue.Empty
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"worker exited with code {dead[0].exitcode}") from None
                continue
            if err is not None:
                raise RuntimeError(err)
            out[index] = times
        return [out[i] for i in range(procs)]
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()  # by its PID
                w.join(timeout=5)


def steps_scaling(ctx_systems: Sequence[str], p: Params) -> int:
    n = 1 + sum(1 for s in ("ems-daemon", "mooncake", "redis") if s in ctx_systems)
    return n * len(p.scaling_procs)


# ---------------------------------------------------------------------- fill
def run_fill(ctx: Context) -> None:
    p = ctx.params
    size, n = p.fill_batch
    cap = p.fill_capacity_bytes
    batch = size * n
    batches = max(3, -(-3 * cap // batch))  # write 3x capacity
    cold_batches = -(-cap // batch)
    src_flat, _ = ctx.buffers(ctx.memcpy)
    src = _rows2d(src_flat, n, size) if src_flat.size >= batch else None
    if src is None:
        src = np.arange(batch, dtype=np.uint8).reshape(n, size)

    def record(name: str, secs: list[float], note: str = "") -> None:
        ctx.fill_series[name] = [((i + 1) * batch / cap, batch / s / 1e9)
                                 for i, s in enumerate(secs)]
        for case, part in (("cold: 0-100% of capacity", secs[:cold_batches]),
                           ("evicting: 100-300%", secs[cold_batches:])):
            if part:
                ctx.rows.append(Row("fill", case, name, "save", batch, part, size,
                                    note=note))

    record("memcpy", _memcpy_fill(cap, src.reshape(-1), batches))
    ctx.progress.step("fill: memcpy")

    for name in ("ems-embedded", "ems-daemon"):
        if name not in ctx.want:
            continue
        daemon: Optional[EmsDaemon] = None
        system: Optional[EmsSystem] = None
        try:
            if name == "ems-embedded":
                system = EmsSystem("embedded", cap)
            else:
                if ctx.daemon is None:
                    ctx.progress.step(f"fill: {name}")
                    continue
                d = tempfile.mkdtemp(prefix="fill-", dir=ctx.work_dir)
                daemon = EmsDaemon(d, cap, d)
                system = EmsSystem("daemon", cap, socket_dir=d)
            secs = []
            for i in range(batches):
                keys = [f"fill-{i}-{k}" for k in range(n)]
                secs.append(_timed(lambda: system.save(keys, src)))  # noqa: B023
            info = system.info()
            record(name, secs, note=f"evictions={info.get('evictions', '?')}")
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            ctx.problem(name, "fill", f"{type(exc).__name__}: {exc}")
        finally:
            if system is not None:
                system.close()
            if daemon is not None:
                daemon.close()
        ctx.progress.step(f"fill: {name}")


def _memcpy_fill(cap: int, flat: np.ndarray, batches: int) -> list[float]:
    """memcpy into fresh pages first, then into the same pages again: the physical limit
    of filling a pool."""
    store = np.empty(cap, dtype=np.uint8)  # large: mmap'd, pages not yet touched
    batch = flat.size
    secs = []
    for i in range(batches):
        off = (i * batch) % (cap - cap % batch)
        dst = store[off: off + batch]
        secs.append(_timed(lambda: np.copyto(dst, flat)))  # noqa: B023 - called at once
    return secs


def steps_fill(want: set[str]) -> int:
    return 1 + sum(1 for s in ("ems-embedded", "ems-daemon") if s in want)


WORKLOADS = ("v0", "v1", "latency", "scaling", "fill")


def steps(workloads: Sequence[str], p: Params, systems: Sequence[str], want: set[str]
          ) -> int:
    n_ems = sum(1 for s in systems if s.startswith("ems-"))
    table = {"v0": lambda: steps_v0(p, len(systems)), "v1": lambda: steps_v1(p, n_ems),
             "latency": lambda: steps_latency(len(systems)),
             "scaling": lambda: steps_scaling(systems, p), "fill": lambda: steps_fill(want)}
    return sum(table[w]() for w in workloads)


def run(ctx: Context, workload: str) -> None:
    {"v0": run_v0, "v1": run_v1, "latency": run_latency, "scaling": run_scaling,
     "fill": run_fill}[workload](ctx)


