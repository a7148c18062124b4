"""The connector's settings and pool session, without vLLM, against a real ems-server:
deadlines when the pool hangs, serving without it when it dies, picking it up again."""

from __future__ import annotations

import logging
import os
import time

import pytest

from ems import CcConfig_v1, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.integrations.session import PoolSession, PoolState, request_write_out
from ems.integrations.settings import ConnectorSettings
from ems.testing import run_server

torch = pytest.importorskip("torch")

BS = 32
HEADS, HEAD = 2, 64


# ---------------------------------------------------------------- settings
def test_settings_defaults_extra_config_and_environment():
    s = ConnectorSettings.from_sources({}, env={})
    assert (s.lookup_timeout_ms, s.load_timeout_ms, s.min_load_tokens) == (200, 5000, 0)
    s = ConnectorSettings.from_sources(
        {"lookup_timeout_ms": "50", "pool": "server"},
        env={"EMS_VLLM_LOOKUP_TIMEOUT_MS": "70", "EMS_VLLM_SAVE_TIMEOUT_MS": "900",
             "EMS_ACCESS_ID": "tenant@x"})
    assert (s.lookup_timeout_ms, s.save_timeout_ms, s.pool, s.access_id) == (
        50, 900, "server", "tenant@x")


@pytest.mark.parametrize("extra, word", [
    ({"lookup_timeout": 5}, "unknown key"),
    ({"lookup_timeout_ms": 0}, "lookup_timeout_ms"),
    ({"load_timeout_ms": "soon"}, "load_timeout_ms"),
    ({"pool": "cloud"}, "pool"),
    ({"health_interval_s": 0}, "health_interval_s"),
    ({"load_failure_policy": "ignore"}, "load_failure_policy"),
])
def test_settings_refuse_bad_input_naming_the_key(extra, word):
    with pytest.raises(EmsException) as info:
        ConnectorSettings.from_sources(extra, env={})
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert word in info.value.message()


def test_write_out_comes_from_the_settings_then_the_requests_params():
    """``write_out``: the extra config or ``EMS_VLLM_WRITE_OUT``, then a request's own
    ``kv_transfer_params["ems_write_out"]`` (a bool, or EMS_INVALID_ARGUMENT naming it)."""
    assert ConnectorSettings.from_sources({}, env={}).option("save").write_out is True
    off = ConnectorSettings.from_sources({"write_out": False}, env={})
    assert off.option("save").write_out is False and off.option("load").write_out is True
    assert off.option("save", True).write_out is True
    env = ConnectorSettings.from_sources({}, env={"EMS_VLLM_WRITE_OUT": "0"})
    assert env.write_out is False
    assert request_write_out(None, True) is True
    assert request_write_out({"other": 1}, False) is False
    assert request_write_out({"ems_write_out": False}, True) is False
    assert request_write_out({"ems_write_out": True}, False) is True
    for bad in ("no", 0, None):
        with pytest.raises(EmsException) as info:
            request_write_out({"ems_write_out": bad}, True)
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "ems_write_out" in info.value.message()
    with pytest.raises(EmsException) as info:
        ConnectorSettings.from_sources({"write_out": "maybe"}, env={})
    assert "write_out" in info.value.message()


def test_a_save_with_write_out_false_is_not_written_to_the_daemons_disk(tmp_path,
                                                                         monkeypatch):
    with run_server(str(tmp_path), capacity="64M",
                    extra_args=["--disk", str(tmp_path / "disk")]) as server:
        for k, v in server.client_env().items():
            monkeypatch.setenv(k, v)
        settings = ConnectorSettings.from_sources({"health_interval_s": 3600}, env={})
        s = PoolSession.get(settings, _config())
        try:
            s.register(_pages(8, fill=True), BS, real=True)
            assert s.save([201, 202], _chunks([0, 1]), write_out=False).result() == 2
            assert s.save([203], _chunks([2])).result() == 1
            assert s.lookup([201, 202, 203], [BS] * 3) == 3
            deadline = time.monotonic() + 20
            while server.stats()["disk"]["objects"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)  # (a block is one object: its layers in one value)
            disk = server.stats()["disk"]
            assert disk["skipped_caller"] == 2 and disk["objects"] == 1
        finally:
            s.close()


# ---------------------------------------------------------------- session
def _config() -> EmsConfig:
    return EmsConfig(cc_config_v1=CcConfig_v1(
        rank_id=0, device_id=0, model_id="tiny", tp_world_size=1, pp_world_size=1,
        rank_in_tp_group=0, rank_in_pp_group=0, llm_engine="vllm-test"))


def _pages(num_blocks: int, fill: bool) -> list[list]:
    """vLLM's CPU layout: per layer [num_blocks, heads, 2*block_size, head]."""
    out = []
    for _ in range(2):
        t = torch.zeros(num_blocks, HEADS, 2 * BS, HEAD)
        if fill:
            t.copy_(torch.randn_like(t))
        out.append([t])
    return out


def _chunks(block_ids):
    """One layer group: each block's whole page (the chunk_descs semantics)."""
    return [[(b * BS, BS) for b in block_ids]]


@pytest.fixture
def session(tmp_path, monkeypatch):
    with run_server(str(tmp_path), capacity="64M") as server:
        for k, v in server.client_env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "1000")
        settings = ConnectorSettings.from_sources(
            {"lookup_timeout_ms": 200, "save_timeout_ms": 2000, "load_timeout_ms": 2000,
             "health_interval_s": 3600}, env={})
        s = PoolSession.get(settings, _config())
        s.server = server
        try:
            yield s
        finally:
            if server.running:
                server.resume()
            s.close()


def test_save_lookup_load_whole_pages(session):
    src = _pages(8, fill=True)
    session.register(src, BS, real=True)
    assert session.state is PoolState.UP
    hashes = [101, 102, 103]
    assert session.save(hashes, _chunks([1, 2, 3])).result() == 3
    assert session.lookup(hashes + [104], [BS] * 4) == 3
    dst = _pages(8, fill=False)
    session.register(dst, BS, real=True)
    assert session.load([(hashes, _chunks([5, 6, 7]))]) == [3]
    for layer in range(2):
        assert torch.equal(dst[layer][0][5:8], src[layer][0][1:4])


def test_a_save_may_carry_the_engines_hashes_for_kv_events(session):
    session.register(_pages(4, fill=True), BS, real=True)
    assert session.save([41, 42], _chunks([0, 1]), [7, (1 << 64) - 1]).result() == 2
    assert session.lookup([41, 42], [BS] * 2) == 2


def test_a_key_collision_is_told_by_the_identity_pages(session):
    """The connector's identity pages ride in the block's pool object: after a load
    they hold the saving request's digests, so a block stored by another prefix under
    the same 64-bit key is told apart (EmsConnector counts it and recomputes)."""
    from ems.integrations.block_keys import ROOT, block_digest, key_of
    from ems.integrations.kv_layout import identity_shape, leading_identities, write_identities

    def with_identity(pages):
        ident = torch.zeros((8, *identity_shape(BS)), dtype=torch.uint8)
        return pages + [[ident]], ident
    src, src_ident = with_identity(_pages(8, fill=True))
    session.register(src, BS, real=True)
    digests, parent = [], ROOT
    for i in range(3):
        parent = block_digest(parent, list(range(i * BS, (i + 1) * BS)), None)
        digests.append(parent)
    write_identities(src_ident, [1, 2, 3], digests)
    keys = [key_of(d) for d in digests]
    assert session.save(keys, _chunks([1, 2, 3])).result() == 3
    dst, dst_ident = with_identity(_pages(8, fill=False))
    session.register(dst, BS, real=True)
    assert session.load([(keys, _chunks([5, 6, 7]))]) == [3]
    assert leading_identities(dst_ident, [5, 6, 7], digests) == 3
    # another prefix whose second block's key collides: its digest differs
    other = [digests[0], block_digest(digests[0], [9] * BS, None), digests[2]]
    assert leading_identities(dst_ident, [5, 6, 7], other) == 1


def test_a_mirror_never_replaces_the_real_layout(session):
    real = _pages(4, fill=True)
    session.register(real, BS, real=True)
    mirror = [[torch.empty(1, HEADS, 2 * BS, HEAD, device="meta")] for _ in range(2)]
    session.register(mirror, BS, real=False)
    assert session.save([7], _chunks([0])).result() == 1  # still the real tensors


def test_hung_pool_lookup_keeps_its_deadline_then_serves_without_it(session, caplog):
    session.register(_pages(4, fill=True), BS, real=True)
    assert session.save([11], _chunks([0])).result() == 1
    session.server.pause()  # SIGSTOP: the socket still accepts, nobody answers
    caplog.set_level(logging.WARNING, logger="ems.integrations.session")
    t0 = time.monotonic()
    assert session.lookup([11], [BS]) == 0
    waited = time.monotonic() - t0
    assert waited < 2.0, f"a 200 ms lookup deadline took {waited:.2f} s"
    assert session.state is PoolState.DOWN
    # DOWN: nothing is sent, every call answers at once
    assert session.lookup([11], [BS]) == 0
    assert session.save([12], _chunks([1])) is None
    assert session.load([([11], _chunks([2]))]) == [0]
    warnings = [r for r in caplog.records if "the pool is unavailable" in r.getMessage()]
    assert len(warnings) == 1
    session.server.resume()
    assert session.probe()
    assert session.state is PoolState.UP and session.recoveries == 1
    assert session.lookup([11], [BS]) == 1


def test_dead_pool_then_restarted(session):
    session.register(_pages(4, fill=True), BS, real=True)
    assert session.save([21], _chunks([0])).result() == 1
    session.server.kill()
    assert session.save([22], _chunks([1])).result() == 0  # failed, counted
    assert session.state is PoolState.DOWN and session.failures >= 1
    assert not session.probe()
    session.server.stop()
    session.server.start()
    assert session.probe()
    # a new daemon: empty, and used again
    assert session.lookup([21], [BS]) == 0
    assert session.save([22], _chunks([1])).result() == 1
    assert session.lookup([22], [BS]) == 1


def test_pool_full_refuses_saves_but_stays_up(tmp_path, monkeypatch):
    with run_server(str(tmp_path), capacity="1M") as server:
        for k, v in server.client_env().items():
            monkeypatch.setenv(k, v)
        settings = ConnectorSettings.from_sources({"health_interval_s": 3600}, env={})
        s = PoolSession.get(settings, _config())
        try:
            pages = _pages(64, fill=True)  # 32 KiB per layer per block: 64 KiB a block
            s.register(pages, BS, real=True)
            n = 40  # 2.5 MiB > 1 MiB
            saved = s.save(list(range(1000, 1000 + n)), _chunks(range(n))).result()
            assert saved < n
            assert s.state is PoolState.UP
        finally:
            s.close()


def test_pool_absent_at_start_is_picked_up_when_it_comes(tmp_path, monkeypatch):
    sock_dir = tmp_path / "sock"
    with run_server(str(tmp_path), capacity="64M", start=False) as server:
        for k, v in server.client_env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "500")
        settings = ConnectorSettings.from_sources({"health_interval_s": 3600}, env={})
        s = PoolSession.get(settings, _config())
        try:
            assert s.state is PoolState.DOWN
            s.register(_pages(4, fill=True), BS, real=True)
            assert s.lookup([1], [BS]) == 0
            assert not s.probe()
            os.makedirs(sock_dir, exist_ok=True)
            server.start()
            assert s.probe()
            assert s.save([31], _chunks([0])).result() == 1
            assert Ems.get_cc() is not None
        finally:
            s.close()
