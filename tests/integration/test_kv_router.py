"""The reference router (``examples/kv_router.py``) over real daemons' KV events:
it picks the host whose shared memory holds the longest prefix of a prompt, and
another host once that one evicted it."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
from support.control_support import free_port

from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

BS = 4
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "kv_router.py")


def _router_module():
    spec = importlib.util.spec_from_file_location("kv_router", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _save(server, client_env, blocks: list[int], hashes: list[int]) -> None:
    """A V1 save of ``blocks`` (with the engine's ``hashes`` for the events)."""
    client_env(server)
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="rt")))
    try:
        cc = Ems.get_cc()
        cc.register_kvcache([[torch.randn(64, BS, 2, 512)]])  # 16 KiB a block
        assert cc.save(hashes=hashes, chunk_descs=[[(b * BS, BS) for b in blocks]],
                       option=CcKvOption(timeout=5000), event_hashes=hashes
                       ).success == len(hashes)
    finally:
        Ems.finalize()


def _until(cond, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _hosts(make_server, client_env, disk: dict[str, list[str]]):
    """Two daemons, ``host-a`` and ``host-b`` (2 MiB pools, ``disk[h]`` their extra
    flags), publishing KV events, and a router subscribed to both once each
    subscription is up (a SUB joins late: a warm-up save until the router sees it)."""
    ports = {h: free_port() for h in disk}
    servers = {h: make_server(capacity="2M", extra_args=disk[h] + [
        "--kv-events", f"tcp://127.0.0.1:{p}", "--host-name", h]) for h, p in ports.items()}
    router = _router_module().KvRouter(
        {h: f"tcp://127.0.0.1:{p}" for h, p in ports.items()})
    try:
        for h, server in servers.items():
            for warm in range(50):
                _save(server, client_env, [0], [900_000 + warm])
                if router.held(h):
                    break
                time.sleep(0.2)
            assert router.held(h), h
    except BaseException:
        router.close()
        raise
    return servers, router


def _evict_from(server, client_env) -> None:
    """200 other blocks (3.1 MiB) through a 2 MiB pool: the first ones are evicted."""
    for j in range(5):
        _save(server, client_env, list(range(40)),
              list(range(100_000 + 40 * j, 100_040 + 40 * j)))


def test_the_router_follows_the_prefix_from_host_to_host(make_server, client_env):
    servers, router = _hosts(make_server, client_env, {"host-a": [], "host-b": []})
    try:
        prompt = list(range(7000, 7008))  # a prompt's 8 block hashes
        _save(servers["host-a"], client_env, list(range(8)), prompt)  # all 8 on a
        _save(servers["host-b"], client_env, list(range(4)), prompt[:4])  # 4 on b
        _until(lambda: router.pick(prompt)[0] == "host-a", "host-a picked")
        assert router.pick(prompt) == ("host-a", 8.0)
        _evict_from(servers["host-a"], client_env)
        _until(lambda: router.pick(prompt)[0] == "host-b", "host-b picked after eviction")
        assert router.pick(prompt) == ("host-b", 4.0)
    finally:
        router.close()


def test_the_router_prefers_a_disk_that_holds_the_prefix_and_memory_over_disk(
        make_server, client_env, tmp_path):
    """Tier labels: host-a (``--disk``) and host-b (none) both evict a prompt from shared
    memory; host-a's disk still holds it (``BlockStored``/``ems-disk``), so the router
    picks host-a at the disk's weight (0.5 a block), not a host that holds nothing;
    once host-b holds the prompt in shared memory again, it wins (1.0 a block)."""
    servers, router = _hosts(make_server, client_env, {
        "host-a": ["--disk", str(tmp_path / "disk-a")], "host-b": []})
    try:
        prompt = list(range(7000, 7008))  # a prompt's 8 block hashes
        for server in servers.values():
            _save(server, client_env, list(range(8)), prompt)
        _until(lambda: router.pick(prompt)[1] == 8.0, "the prompt in shared memory")
        for server in servers.values():
            _evict_from(server, client_env)
        _until(lambda: router.pick(prompt) == ("host-a", 4.0), "host-a's disk picked")
        _save(servers["host-b"], client_env, list(range(8)), prompt)
        _until(lambda: router.pick(prompt) == ("host-b", 8.0), "host-b's memory picked")
    finally:
        router.close()
