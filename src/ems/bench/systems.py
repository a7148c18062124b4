"""The systems the bench compares, behind one small interface, and the services they need.

A system moves a batch of ``n`` values of ``size`` bytes, rows of a 2-D ``uint8``
array, into its store (``save``) and back into caller memory (``load``):

* ``memcpy``: ``np.copyto`` into a pre-touched array: the physical limit.
* ``ems-embedded`` / ``ems-daemon``: ``ContextCaching.save/load`` with
  ``KvBufferWrapper`` lists, on the in-process pool or through ``ems-server``.
  Both are built the way ``Ems.init`` builds them (``open_transport`` +
  ``ContextCaching``), so the two can run side by side in one process.
* ``mooncake``: Mooncake Store's same-host shared-memory path: a ``mooncake_client``
  process owns the memory, this process is a "dummy" client whose buffers come from
  ``alloc_from_mem_pool`` + ``register_buffer``; zero-copy ``batch_put_from`` /
  ``batch_get_into``.
* ``redis``: ``redis-server`` on a unix socket, redis-py + hiredis, pipelined SET/GET;
  a load copies the returned bytes into caller memory.

Keys are fresh for every save (ems and Mooncake keys are write-once). ``reset()`` runs
untimed between repetitions: peers delete what the last one stored; ems relies on its
LRU eviction, as it does in service.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from ems.bench.procs import Service, free_port, wait_for
from ems.config import PoolSettings

__all__ = [
    "BenchError", "Unavailable", "System", "MemcpySystem", "LimitSystem", "LIMITS",
    "EmsSystem", "MooncakeSystem",
    "RedisSystem", "EmsDaemon", "MooncakeService", "RedisService", "touched",
    "start_mooncake_master",
    "lmcache_unavailable_reason",
]


class BenchError(RuntimeError):
    """A system answered wrongly (a save or load that did not complete)."""


class Unavailable(RuntimeError):
    """A system cannot run here; the message says why (it is reported, never hidden)."""


def touched(nbytes: int) -> np.ndarray:
    """A ``uint8`` array whose pages are already faulted in."""
    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(0)
    return a


def _view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class System:
    """One system under test. ``src``/``dst`` are ``[n, size]`` views of :meth:`alloc`."""

    name = "?"
    kind = "peer"  # "baseline" | "ems" | "peer"

    def alloc(self, nbytes: int) -> np.ndarray:
        """Caller memory the system saves from / loads into (pre-touched)."""
        return touched(nbytes)

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        raise NotImplementedError

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Untimed, before a save: forget earlier values if the system needs to."""

    def warm(self, src: np.ndarray, capacity_bytes: int) -> None:
        """Untimed: touch the store's memory once, as a long-running pool has."""

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- memcpy
class MemcpySystem(System):
    name, kind = "memcpy", "baseline"

    def __init__(self, capacity_bytes: int) -> None:
        self._store = touched(capacity_bytes)

    def _rows(self, like: np.ndarray) -> np.ndarray:
        n, size = like.shape
        return self._store[: n * size].reshape(n, size)

    def _run(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy one run (the kernel: numpy's ``copyto`` here)."""
        np.copyto(dst, src)

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        store = self._rows(src)
        for i in range(len(keys)):
            self._run(store[i], src[i])

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        store = self._rows(dst)
        for i in range(len(keys)):
            self._run(dst[i], store[i])

    def copy(self, nbytes: int, src: np.ndarray) -> None:
        """One contiguous copy of ``nbytes`` (in chunks of ``src``), for V1's baseline."""
        flat = src.reshape(-1)
        done = 0
        while done < nbytes:
            k = min(flat.size, nbytes - done, self._store.size)
            self._run(self._store[:k], flat[:k])
            done += k

    def close(self) -> None:
        self._store = np.empty(0, np.uint8)


class LimitSystem(MemcpySystem):
    """The honest limit: the same runs copied between pre-faulted buffers by the best
    kernels there are, ems's native streaming-store copy (``copy-nt``) and glibc's
    ``memcpy`` (``copy-glibc``); a row's limit is the faster of the two. numpy's
    ``copyto`` (the ``memcpy`` row) ran 1 MiB runs at ~6-7 GB/s on the 2-vCPU benchmark
    host (docs/benchmarks.md) where a streaming-store copy ran ~10-12 GB/s: ratios above
    1 against it said the baseline was slow, not that ems beat the hardware. V1's rows
    copy the request's own block runs (:meth:`copy_runs`: each block of each cache
    tensor into a store laid out like pool objects), not one contiguous stream, which
    ran 19-21 GB/s where those runs copy at 16-18."""

    kind = "limit"

    def __init__(self, capacity_bytes: int, kernel: str) -> None:
        super().__init__(capacity_bytes)
        if kernel == "nt":
            from ems.client import native
            if native.copy_one is None:
                raise Unavailable("the native copy helper (ems._native) is not built")
            self._copy: Any = native.copy_one
        else:
            self._copy = ctypes.memmove
        self.name = f"copy-{kernel}" if kernel == "nt" else "copy-glibc"

    def _run(self, dst: np.ndarray, src: np.ndarray) -> None:
        self._copy(dst.ctypes.data, src.ctypes.data, src.nbytes)

    def copy_runs(self, dst: Any, src: Any, length: int) -> None:
        """Copy run ``i`` (``length`` bytes) from ``src[i]`` to ``dst[i]`` (int64 address
        tensors): copy-nt in one native call, copy-glibc a ``memmove`` per run."""
        if self.name == "copy-nt":
            from ems.client import native
            native.copy_runs(dst, src, length)
            return
        move = self._copy
        for d, s in zip(dst.tolist(), src.tolist()):
            move(d, s, length)


LIMITS = ("copy-nt", "copy-glibc")


# ---------------------------------------------------------------------- ems
class EmsDaemon:
    """An ``ems-server`` subprocess on a unix socket in ``socket_dir``."""

    def __init__(self, socket_dir: str, capacity_bytes: int, log_dir: str,
                 timeout_s: float = 30.0, extra_args: Sequence[str] = ()) -> None:
        if importlib.util.find_spec("ems.server.__main__") is None:
            raise Unavailable("this build has no ems-server (ems.server.__main__ missing)")
        self.socket_dir = socket_dir
        self.capacity_bytes = capacity_bytes
        os.makedirs(socket_dir, exist_ok=True)
        argv = [sys.executable, "-m", "ems.server", "--socket-dir", socket_dir,
                "--capacity", str(capacity_bytes), "--log-level", "WARNING", *extra_args]
        self.service = Service("ems-server", argv, os.path.join(log_dir, "ems-server.log"))
        sock = os.path.join(socket_dir, PoolSettings.SOCKET_NAME)
        try:
            wait_for("ems-server", lambda: _unix_accepts(sock), self.service, timeout_s)
        except RuntimeError as exc:
            self.service.stop()
            raise Unavailable(str(exc)) from None

    def close(self) -> None:
        self.service.stop()


@contextlib.contextmanager
def ems_pool(pool: str, capacity_bytes: int, prefix: str = "ems-",
             disk_bytes: Optional[int] = None, server_args: Sequence[str] = ()
             ) -> Iterator["EmsSystem"]:
    """An :class:`EmsSystem` on the embedded pool (``pool`` "embedded") or through a
    fresh ems-server in a temp dir ("daemon"; with ``disk_bytes``, its disk tier of that
    size in the same dir, checkpointed every 60 s; ``server_args``: more of its flags):
    the profiling scripts' and the trace replay's set-up; the system, the daemon and
    the dir are gone afterwards."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    daemon = None
    try:
        if pool == "daemon":
            extra = [] if disk_bytes is None else [
                "--disk", os.path.join(tmp, "disk"), "--disk-capacity", str(disk_bytes),
                "--disk-checkpoint-s", "60"]
            daemon = EmsDaemon(os.path.join(tmp, "ems"), capacity_bytes, tmp,
                               extra_args=[*extra, *server_args])
            system = EmsSystem("daemon", capacity_bytes, socket_dir=daemon.socket_dir)
        else:
            system = EmsSystem("embedded", capacity_bytes)
        try:
            yield system
        finally:
            system.close()
    finally:
        if daemon is not None:
            daemon.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _unix_accepts(path: str) -> bool:
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(path) == 0


class EmsSystem(System):
    """``ContextCaching`` V0 save/load on the embedded pool or through the daemon."""

    kind = "ems"

    def __init__(self, mode: str, capacity_bytes: int, socket_dir: Optional[str] = None,
                 workers: int = 4) -> None:
        from ems import CcConfig, CcConfig_v1, CcKvOption, EmsConfig
        from ems.client.context_caching import ContextCaching
        from ems.client.singleton import open_transport
        from ems.config import PoolSettings

        self.name = f"ems-{mode}"
        kwargs: dict[str, Any] = {"mode": "embedded" if mode == "embedded" else "server",
                                  "capacity_bytes": capacity_bytes, "workers": workers,
                                  "connect_timeout_ms": 10000}
        if socket_dir is not None:
            kwargs["socket_dir"] = socket_dir
        cc0 = CcConfig(rank_id=0, device_id=0, model_id="bench-model")
        cc1 = CcConfig_v1(rank_id=0, device_id=0, model_id="bench-model",
                          llm_engine="bench@ems")
        config = EmsConfig(cc_config=cc0, cc_config_v1=cc1)
        try:
            # The SDK's other settings (EMS_SPIN_US) from the environment, as in Ems.init.
            settings = dataclasses.replace(PoolSettings.from_env(), **kwargs)
            self.transport = open_transport(settings, config)
        except Exception as exc:  # noqa: BLE001 - reported as the reason
            raise Unavailable(f"cannot reach the pool: {exc}") from None
        self.cc = ContextCaching(self.transport, cc0, cc1, workers=workers)
        # Generous deadline: the bench measures speed, a timeout would only lose a point.
        self.option = CcKvOption(timeout=120_000)
        self.capacity_bytes = capacity_bytes
        self._wrappers: dict[tuple[int, int, int, int], list] = {}
        self._last: Optional[tuple[np.ndarray, list]] = None
        self._warm_seq = 0

    def _values(self, arr: np.ndarray) -> list:
        # The wrappers of a memory region are made once (the bench reuses its buffers);
        # the latency loop passes the same array every call and finds it by id (the
        # cache holds the array, so its id cannot be taken by another meanwhile).
        last = self._last
        if last is not None and last[0] is arr:
            return last[1]
        n, size = arr.shape
        key = (arr.ctypes.data, n, size, arr.strides[0])
        values = self._wrappers.get(key)
        if values is None:
            from ems import KvBufferWrapper
            values = [[KvBufferWrapper(key[0] + i * key[3], size)] for i in range(n)]
            self._wrappers[key] = values
        self._last = (arr, values)
        return values

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        stored = self.save_stored(keys, src)
        if stored != len(keys):
            raise BenchError(f"{self.name} save stored {stored}/{len(keys)}")

    def save_stored(self, keys: Sequence[str], src: np.ndarray) -> int:
        """Save the rows of ``src`` under ``keys``; how many leading keys are stored
        (the trace replay's saves, where a refusal is a figure, not an error)."""
        return int(self.cc.save(self.option, list(keys), self._values(src)).success)

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        found = self.load_found(keys, dst)
        if found != len(keys):
            raise BenchError(f"{self.name} load found {found}/{len(keys)}")

    def load_found(self, keys: Sequence[str], dst: np.ndarray) -> int:
        """Load ``keys`` into the rows of ``dst``; how many were found (the disk
        bench's loads, where a miss is a figure, not an error)."""
        return int(self.cc.load(self.option, list(keys), self._values(dst)).success)

    def warm(self, src: np.ndarray, capacity_bytes: int) -> None:
        # Write the whole pool once: later saves evict and reuse faulted-in pages,
        # the steady state of a long-running cache. (The fill workload measures cold.)
        written = 0
        while written < self.capacity_bytes:
            self._warm_seq += 1
            keys = [f"warm{self._warm_seq}-{i}" for i in range(src.shape[0])]
            self.save(keys, src)
            written += src.nbytes

    def daemon_report(self) -> Optional[dict[str, Any]]:
        """The daemon's whole report (``ems stats --json``); None on the embedded pool."""
        from ems.client.remote import RemoteTransport
        if not isinstance(self.transport, RemoteTransport):
            return None
        return self.transport.server_report(all_tenants=True)

    def info(self) -> dict[str, Any]:
        try:
            stats = self.cc.statistics()
            return {k: getattr(stats, k) for k in ("capacity_bytes", "used_bytes", "objects",
                                                    "evictions") if hasattr(stats, k)}
        except Exception:  # noqa: BLE001
            return {}

    def close(self) -> None:
        self._wrappers.clear()
        self._last = None
        try:
            self.cc.close()
        finally:
            self.transport.close()


# ---------------------------------------------------------------------- Mooncake
def _mooncake_dir() -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("PyPI mooncake-transfer-engine-non-cuda is not installed "
                          "(bash benchmarks/setup-peers.sh)")
    return list(spec.submodule_search_locations)[0]


class MooncakeService:
    """``mooncake_master`` + a ``mooncake_client`` that owns ``capacity_bytes``, on
    127.0.0.1 only, with the P2P handshake (no HTTP metadata server)."""

    def __init__(self, capacity_bytes: int, log_dir: str, timeout_s: float = 30.0) -> None:
        mdir = _mooncake_dir()
        os.environ.setdefault("GLOG_minloglevel", "2")  # its client logs INFO to stderr
        try:
            import mooncake.store  # noqa: F401 - fails without libibverbs
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"mooncake.store does not import: {exc} (Debian libibverbs1 "
                              f"ibverbs-providers: bash benchmarks/setup-peers.sh)") from None
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # for our own dummy clients
        self.services: list[Service] = []
        port = free_port()
        self.client_address = f"127.0.0.1:{port}"
        try:
            master, self.master_address = start_mooncake_master(log_dir, env, timeout_s)
            self.services.append(master)
            client = Service("mooncake_client", [
                os.path.join(mdir, "mooncake_client"), "--host=127.0.0.1", f"--port={port}",
                f"--global_segment_size={capacity_bytes}", "--local_buffer_size=64MB",
                f"--master_server_address={self.master_address}",
                "--metadata_server=P2PHANDSHAKE",
                # its copies run on these threads: one per CPU, as ems's clients copy
                # on every CPU (the default, 1, caps several clients at one core)
                f"--threads={os.cpu_count() or 1}",
            ], os.path.join(log_dir, "mooncake_client.log"), env=env)
            self.services.append(client)
            wait_for("mooncake_client", lambda: _tcp_open(port), client, timeout_s)
        except BaseException as exc:
            self.close()
            if isinstance(exc, RuntimeError):
                raise Unavailable(str(exc)) from None
            raise
        self.capacity_bytes = capacity_bytes

    def close(self) -> None:
        for s in reversed(self.services):
            s.stop()
        self.services.clear()


def start_mooncake_master(log_dir: str, env: dict[str, str],
                          timeout_s: float = 30.0) -> tuple[Service, str]:
    """``mooncake_master`` on 127.0.0.1 (RPC and metrics ports free a moment ago), ready;
    returns the service and its RPC address. RuntimeError (with its log) if it fails."""
    rpc, metrics = free_port(), free_port()
    master = Service("mooncake_master", [
        os.path.join(_mooncake_dir(), "mooncake_master"), "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc}", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
    ], os.path.join(log_dir, "mooncake_master.log"), env=env)
    try:
        wait_for("mooncake_master", lambda: _tcp_open(rpc), master, timeout_s)
    except BaseException:
        master.stop()
        raise
    return master, f"127.0.0.1:{rpc}"


def _tcp_open(port: int) -> bool:
    import socket
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class MooncakeSystem(System):
    name = "mooncake"

    def __init__(self, client_address: str, mem_pool_bytes: int,
                 capacity_bytes: int = 0) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        from mooncake.store import MooncakeDistributedStore
        self.store = MooncakeDistributedStore()
        rc = self.store.setup_dummy(mem_pool_bytes, 64 << 20, client_address)
        if rc != 0:
            raise Unavailable(f"Mooncake setup_dummy({client_address}) returned {rc}")
        self.capacity_bytes = capacity_bytes
        self._ptrs: dict[tuple[int, int, int], list[int]] = {}

    def alloc(self, nbytes: int) -> np.ndarray:
        addr = self.store.alloc_from_mem_pool(nbytes)
        if not addr:
            raise Unavailable(f"Mooncake alloc_from_mem_pool({nbytes}) failed")
        rc = self.store.register_buffer(addr, nbytes)
        if rc != 0:
            raise Unavailable(f"Mooncake register_buffer returned {rc}")
        a = _view(addr, nbytes)
        a.fill(0)
        return a

    def _args(self, arr: np.ndarray) -> tuple[list[int], list[int]]:
        n, size = arr.shape
        key = (arr.ctypes.data, n, size)
        ptrs = self._ptrs.get(key)
        if ptrs is None:
            ptrs = [arr.ctypes.data + i * arr.strides[0] for i in range(n)]
            self._ptrs[key] = ptrs
        return ptrs, [size] * n

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        ptrs, sizes = self._args(src)
        rcs = self.store.batch_put_from(list(keys), ptrs, sizes)
        bad = [rc for rc in rcs if rc != 0]
        if bad:
            raise BenchError(f"mooncake batch_put_from: {len(bad)}/{len(keys)} failed "
                             f"(first code {bad[0]})")

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        ptrs, sizes = self._args(dst)
        rcs = self.store.batch_get_into(list(keys), ptrs, sizes)
        bad = [rc for rc, n in zip(rcs, sizes) if rc != n]
        if bad:
            raise BenchError(f"mooncake batch_get_into: {len(bad)}/{len(keys)} failed "
                             f"(first code {bad[0]})")

    def remove(self, keys: Sequence[str]) -> None:
        self.store.batch_remove(list(keys), True)  # force: a get leaves a 10 s lease

    def reset(self) -> None:
        self.store.remove_all(True)

    def warm(self, src: np.ndarray, capacity_bytes: int) -> None:
        written, seq = 0, 0
        while written + src.nbytes <= 0.9 * (self.capacity_bytes or capacity_bytes):
            seq += 1
            self.save([f"warm{seq}-{i}" for i in range(src.shape[0])], src)
            written += src.nbytes
        self.reset()

    def close(self) -> None:
        self._ptrs.clear()
        try:
            self.store.close()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------- Redis
class RedisService:
    """``redis-server`` on a unix socket (no TCP port), persistence off."""

    def __init__(self, work_dir: str, timeout_s: float = 20.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise Unavailable("redis-server is not installed (bash benchmarks/setup-peers.sh)")
        try:
            import redis  # noqa: F401
        except ImportError:
            raise Unavailable("redis-py is not installed (bash benchmarks/setup-peers.sh)"
                              ) from None
        self.socket_path = os.path.join(work_dir, "redis.sock")
        self.service = Service("redis-server", [
            exe, "--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", work_dir, "--daemonize", "no",
            "--protected-mode", "yes", "--maxmemory", "0", "--io-threads", "1",
        ], os.path.join(work_dir, "redis-server.log"))
        import redis
        try:
            wait_for("redis-server",
                     lambda: redis.Redis(unix_socket_path=self.socket_path).ping(),
                     self.service, timeout_s)
        except RuntimeError as exc:
            self.service.stop()
            raise Unavailable(str(exc)) from None
        self.version = _redis_version(exe)

    def close(self) -> None:
        self.service.stop()


def _redis_version(exe: str) -> str:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5)
        return next((w[2:] for w in out.stdout.split() if w.startswith("v=")), "?")
    except Exception:  # noqa: BLE001
        return "?"


class RedisSystem(System):
    name = "redis"

    def __init__(self, socket_path: str) -> None:
        import redis
        self.r = redis.Redis(unix_socket_path=socket_path)
        self.hiredis = bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False))
        if not self.hiredis:
            raise Unavailable("redis-py runs without hiredis (pip install hiredis)")

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        pipe = self.r.pipeline(transaction=False)
        for i, k in enumerate(keys):
            pipe.set(k, memoryview(src[i]))
        if not all(pipe.execute()):
            raise BenchError("redis SET failed")

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        for i, v in enumerate(pipe.execute()):
            if v is None or len(v) != dst.shape[1]:
                raise BenchError(f"redis GET {keys[i]} missed")
            dst[i] = np.frombuffer(v, dtype=np.uint8)

    def remove(self, keys: Sequence[str]) -> None:
        self.r.delete(*keys)

    def reset(self) -> None:
        self.r.flushall()

    def close(self) -> None:
        self.r.close()


def lmcache_unavailable_reason() -> str:
    """LMCache is optional; the bench reports why it did not run."""
    if importlib.util.find_spec("lmcache") is None:
        return ("optional peer, not installed (EMS_BENCH_LMCACHE=1 bash "
                "benchmarks/setup-peers.sh)")
    return "installed, but this bench has no driver for LMCache's multiprocess server yet"
