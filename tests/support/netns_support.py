"""Helpers of the netns bed's tests (imported as ``support.netns_support``)."""

from __future__ import annotations

import ctypes
import hashlib
import time
from typing import Any, Optional

from ems import CcConfig, CcKvOption, EmsException, KvBufferWrapper
from ems.client.context_caching import ContextCaching
from ems.client.remote import RemoteTransport
from ems.cluster.keys import cluster_key
from ems.keys import v0_storage_keys
from ems.testing import netns


def pattern(key: str, size: int) -> bytes:
    block = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


class Host:
    """One host of the bed: its daemon and an SDK client on it."""

    def __init__(self, bed: netns.NetBed, number: int, server: Any) -> None:
        self.bed, self.number, self.server = bed, number, server
        self.transport = RemoteTransport.connect(server.socket_path, None, None, 5.0)
        self.cc = ContextCaching(self.transport, CcConfig(rank_id=0, device_id=0,
                                                          model_id="m"), None, tenant="")

    def save(self, keys: list[Any], size: int, **kw: Any) -> int:
        bufs = [ctypes.create_string_buffer(pattern(str(k), size), size) for k in keys]
        wrappers = [[KvBufferWrapper(ctypes.addressof(b), size)] for b in bufs]
        return self.cc.save(CcKvOption(**{"timeout": 3000, **kw}), keys, wrappers).success

    def load(self, keys: list[Any], size: int, timeout_ms: int = 1000) -> "Outcome":
        """Load ``keys``; never raises (an exception is an outcome the tests count)."""
        bufs = [ctypes.create_string_buffer(size) for _ in keys]
        wrappers = [[KvBufferWrapper(ctypes.addressof(b), size)] for b in bufs]
        t0 = time.monotonic()
        try:
            n = self.cc.load(CcKvOption(timeout=timeout_ms), keys, wrappers).success
            error: Optional[str] = None
        except EmsException as exc:
            n, error = 0, str(exc)
        took = time.monotonic() - t0
        wrong = sum(1 for k, b in zip(keys[:n], bufs) if b.raw != pattern(str(k), size))
        return Outcome(n, wrong, took, error)

    def close(self) -> None:
        self.cc.close()
        self.transport.close()


class Outcome:
    __slots__ = ("hits", "wrong", "took_s", "error")

    def __init__(self, hits: int, wrong: int, took_s: float, error: Optional[str]) -> None:
        self.hits, self.wrong, self.took_s, self.error = hits, wrong, took_s, error

    def __repr__(self) -> str:
        return (f"Outcome(hits={self.hits}, wrong={self.wrong}, "
                f"took={self.took_s * 1000:.0f} ms, error={self.error!r})")


def ckey(key: Any) -> bytes:
    return cluster_key("(anonymous)", v0_storage_keys([key])[0])


def keys_on(bed: netns.NetBed, node: int, prefix: str, count: int) -> list[str]:
    """``count`` keys whose home is ``node``."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        k = f"{prefix}-{i}"
        if bed.node_of(ckey(k)) == node:
            out.append(k)
        i += 1
    return out


def wait_stored(bed: netns.NetBed, keys: list[str], timeout_s: float = 10.0) -> None:
    """Until every key is on its home node (a write-behind has landed)."""
    deadline = time.monotonic() + timeout_s
    for k in keys:
        ck = ckey(k)
        while bed.call(bed.node_of(ck), "EXISTS", ck) != 1:
            assert time.monotonic() < deadline, f"{k} never reached its home node"
            time.sleep(0.02)


#: The bound docs/multi-host.md gives for cluster hits after a heal: an open breaker
#: (2 s) plus a probe and a reconnect, with room for a loaded CI machine.
HEAL_BOUND_S = 5.0


def heal_time(host: Host, key: str, size: int, limit_s: float = HEAL_BOUND_S) -> float:
    """Seconds until ``host`` gets a cluster hit of ``key`` (not in its local pool:
    a miss fills nothing), probing every 50 ms; fails past ``limit_s``."""
    t0 = time.monotonic()
    while True:
        got = host.load([key], size, timeout_ms=500)
        assert got.error is None and got.wrong == 0, got
        if got.hits:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit_s, "no cluster hit after the heal"
        time.sleep(0.05)
