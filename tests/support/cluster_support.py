"""Helpers of the cluster tests."""

from __future__ import annotations

from typing import Any, Optional

from ems import CcConfig, CcKvOption
from ems.client.context_caching import ContextCaching
from ems.client.remote import RemoteTransport
from support.client_worker import Value, pattern
from support.itest_support import wait_for as wait_until  # noqa: F401 - used by the tests


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
