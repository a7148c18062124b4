"""Helpers of the cluster tests (importable: the test dir is on sys.path)."""

from __future__ import annotations

import ctypes
import hashlib
import time
from typing import Any, Optional

from ems import CcConfig, CcKvOption, KvBufferWrapper
from ems.client.context_caching import ContextCaching
from ems.client.remote import RemoteTransport


class Host:
    """One simulated host: a daemon joined to the cluster, and its SDK client."""

    def __init__(self, server: Any, access_id: Optional[str] = None,
                 access_key: Optional[str] = None, v1: Any = None) -> None:
        self.server = server
        self.transport = RemoteTransport.connect(server.socket_path, access_id, access_key,
                                                 5.0)
        self.cc = ContextCaching(self.transport, CcConfig(rank_id=0, device_id=0,
                                                          model_id="m"), v1,
                                 tenant=access_id or "")

    def report(self) -> dict:
        return self.server.stats()

    def tenant_row(self, name: str = "(anonymous)") -> dict:
        return self.report()["tenants"][name]

    def close(self) -> None:
        self.cc.close()
        self.transport.close()


def pattern(key: str, size: int) -> bytes:
    """The value of ``key`` (a pure function of it: any host can check any key)."""
    block = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


class Value:
    """A V0 value in two host buffers."""

    def __init__(self, size: int, data: bytes = b"") -> None:
        half = size // 2
        self.parts = [ctypes.create_string_buffer(half), ctypes.create_string_buffer(size - half)]
        if data:
            ctypes.memmove(self.parts[0], data[:half], half)
            ctypes.memmove(self.parts[1], data[half:], size - half)

    def wrappers(self) -> list:
        return [KvBufferWrapper(ctypes.addressof(p), len(p)) for p in self.parts]

    def bytes(self) -> bytes:
        return b"".join(p.raw for p in self.parts)


def opt(**kw: Any) -> CcKvOption:
    kw.setdefault("timeout", 3000)
    return CcKvOption(**kw)


def save(host: Any, keys: list, size: int, option: Optional[CcKvOption] = None) -> int:
    values = [Value(size, pattern(str(k), size)) for k in keys]
    return host.cc.save(option or opt(), keys, [v.wrappers() for v in values]).success


def load(host: Any, keys: list, size: int, option: Optional[CcKvOption] = None
         ) -> tuple[int, int]:
    """(success, wrong): wrong counts loaded keys whose bytes are not their pattern."""
    values = [Value(size) for _ in keys]
    n = host.cc.load(option or opt(), keys, [v.wrappers() for v in values]).success
    wrong = sum(1 for k, v in zip(keys[:n], values) if v.bytes() != pattern(str(k), size))
    return n, wrong


def wait_until(check: Any, timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)
