"""Helpers of the control-plane tests (a module of its own name: ``conftest`` is
taken by every test directory)."""

from __future__ import annotations

import socket

from support.itest_support import wait_for  # noqa: E402,F401 - shared with the integration tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect_when_registered(server, access_id: str, key: str, timeout_s: float = 5.0):
    """A transport of ``access_id`` to ``server``, once the daemon's registry has it."""
    from ems.client.remote import RemoteTransport
    from ems.errors import EmsException

    def connect():
        try:
            return RemoteTransport.connect(server.socket_path, access_id, key, 3.0)
        except EmsException:  # not in the registry yet
            return None
    return wait_for(connect, timeout_s, f"the tenant {access_id}")


def scrape(port: int) -> dict:
    """The Prometheus families a daemon's exporter serves, parsed by prometheus_client."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str = "", **labels: str) -> float:
    """The one sample of ``name`` (``_total`` for counters) with ``labels``."""
    family = families[name]
    want = sample or (name + "_total" if family.type == "counter" else name)
    hits = [s.value for s in family.samples
            if s.name == want and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, family.samples)
    return hits[0]
