"""The daemon as a program and as a shared pool: processes share bytes through it,
V0 and V1 go through it, its CLI, config, stats and lifecycle behave as documented."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support.client_worker import Value, pattern
from support.itest_support import anonymous_stats_when, wait_for

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.testing import run_server

pytestmark = pytest.mark.integration


def values_for(keys, size, data=True):
    return [Value(size, pattern(k, size) if data else b"") for k in keys]


# ---------------------------------------------------------------- sharing

def test_process_a_saves_process_b_loads(server, workers):
    keys = [f"shared-{i}" for i in range(16)]
    assert workers.run(server, "save", keys=keys, size=65536) == {"success": 16}
    got = workers.run(server, "load", keys=keys + ["missing", "after-hole"], size=65536)
    assert got == {"success": 16, "wrong": 0}
    report = server.stats()["tenants"]["(anonymous)"]
    assert report["objects"] == 16 and report["hits"] >= 16


def test_in_process_v0_through_the_daemon(cc, server):
    option = CcKvOption(timeout=5000)
    keys = ["a", "b", "c"]
    vals = values_for(keys, 10000)
    assert cc.save(option, keys, [v.wrappers() for v in vals]).success == 3
    # write-once: saving again counts as stored without a copy
    assert cc.save(option, keys, [v.wrappers() for v in vals]).success == 3
    out = values_for(keys + ["zz"], 10000, data=False)
    res = cc.load(option, keys + ["zz"], [v.wrappers() for v in out])
    assert (res.success, res.total) == (3, 4)
    assert [v.bytes() for v in out[:3]] == [pattern(k, 10000) for k in keys]
    assert cc.statistics().objects == 3
    assert Ems._state()["pool"] == "server"
    assert Ems.check_health()


def test_a_size_mismatch_is_a_miss_and_writes_nothing(cc):
    option = CcKvOption()
    (v,) = values_for(["x"], 4096)
    assert cc.save(option, ["x"], [v.wrappers()]).success == 1
    out = Value(8192)
    assert cc.load(option, ["x"], [out.wrappers()]).success == 0
    assert out.bytes() == bytes(8192)


def test_async_requests_share_one_connection(cc):
    option = CcKvOption(timeout=10000)
    batches = [[f"b{j}-{i}" for i in range(8)] for j in range(12)]
    keep = []
    futs = []
    for keys in batches:
        vals = values_for(keys, 8192)
        keep.append(vals)
        futs.append(cc.async_save(option, keys, [v.wrappers() for v in vals]))
    assert [f.result().success for f in futs] == [8] * 12
    loads = []
    for keys in batches:
        out = values_for(keys, 8192, data=False)
        loads.append((keys, out, cc.async_load(option, keys, [v.wrappers() for v in out])))
    for keys, out, fut in loads:
        assert fut.result().success == 8
        assert [v.bytes() for v in out] == [pattern(k, 8192) for k in keys]


@pytest.mark.torch
def test_v1_through_the_daemon_survives_a_new_session(server, client_env):
    torch = pytest.importorskip("torch")
    from ems import CcConfig_v1
    client_env(server)
    cfg = CcConfig_v1(rank_id=0, device_id=0, model_id="m", tp_world_size=1,
                      pp_world_size=1, rank_in_tp_group=0, rank_in_pp_group=0,
                      llm_engine="vllm@itest")

    def caches(fill):
        gen = torch.Generator().manual_seed(7)
        return [[(torch.rand(6, 4, 2, 8, generator=gen) if fill else torch.zeros(6, 4, 2, 8))
                 for _ in range(2)] for _ in range(3)]
    src = caches(True)
    Ems.init(EmsConfig(cc_config_v1=cfg))
    cc = Ems.get_cc()
    cc.register_kvcache(src)
    slots = list(range(4, 12))  # blocks 1 and 2
    assert cc.save(slots, [11, 22], [4, 4]).success == 2
    Ems.finalize()  # a new connection (as after a process restart) still finds them

    Ems.init(EmsConfig(cc_config_v1=cfg))
    cc = Ems.get_cc()
    dst = caches(False)
    cc.register_kvcache(dst)
    assert cc.exists([11, 22, 33]).success == 2
    assert cc.load(slots, [11, 22], [4, 4]).success == 2
    assert cc.load(hashes=[11, 22], chunk_descs=[[(4, 4), (8, 4)]]).success == 2
    for layer_src, layer_dst in zip(src, dst):
        for s, d in zip(layer_src, layer_dst):
            assert torch.equal(s[1:3], d[1:3])
            assert not d[0].any() and not d[3:].any()
    Ems.finalize()


def test_auto_mode_picks_the_daemon_when_its_socket_exists(server, monkeypatch, tmp_path):
    monkeypatch.setenv("EMS_POOL", "auto")
    monkeypatch.setenv("EMS_SOCKET_DIR", server.socket_dir)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert Ems._state()["pool"] == "server"
    Ems.finalize()
    monkeypatch.setenv("EMS_SOCKET_DIR", str(tmp_path / "nothing-here"))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert Ems._state()["pool"] == "embedded"


# ---------------------------------------------------------------- program

def test_start_line_sigterm_and_cleanup(make_server):
    server = make_server(capacity="32M", reservation_ttl_s=7)
    # (the socket accepts from listen() on, a moment before the line is written)
    line = wait_for(lambda: [x for x in server.log().splitlines() if "listening on" in x],
                    5.0, "the start line")
    assert len(line) == 1
    assert server.socket_path in line[0] and "capacity 32 MiB" in line[0]
    assert "anonymous only" in line[0] and "TTL 7.0 s" in line[0]
    assert server.stop() == 0
    assert not os.path.exists(server.socket_path)
    assert os.listdir(server.socket_dir) == []
    assert "stopped" in server.log()


def test_refuses_a_second_daemon_and_takes_over_a_stale_socket(server):
    second = subprocess.run([sys.executable, "-m", "ems.server", "--socket-dir",
                             server.socket_dir], capture_output=True, text=True, timeout=30)
    assert second.returncode == 1
    assert "another ems-server is running" in second.stderr
    assert server.running  # the first one was not disturbed
    server.kill()
    assert os.path.exists(server.socket_path)  # stale socket left by the crash
    server.start()
    assert "replacing the stale socket" in server.log()
    assert server.stats()["server"]["pid"] == server.pid


def test_bad_configuration_exits_2_with_a_clear_message(tmp_path):
    def run(*args, env=None):
        return subprocess.run([sys.executable, "-m", "ems.server", "--socket-dir",
                               str(tmp_path / "s"), *args], capture_output=True, text=True,
                              timeout=30, env=dict(os.environ, **(env or {})))
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants]\nteam-a = "{"k" * 32}"\n')
    os.chmod(tenants, 0o644)
    r = run("--tenants-file", str(tenants))
    assert r.returncode == 2 and "must be 0600" in r.stderr
    conf = tmp_path / "ems.toml"
    conf.write_text('capacity = "64M"\ncolour = "blue"\n')
    r = run("--config", str(conf))
    assert r.returncode == 2 and "colour" in r.stderr
    r = run("--capacity", "lots")
    assert r.returncode == 2 and "capacity" in r.stderr
    r = run("--no-anonymous")
    assert r.returncode == 2 and "nobody could connect" in r.stderr
    r = run(env={"EMS_RESERVATION_TTL_S": "soon"})
    assert r.returncode == 2 and "EMS_RESERVATION_TTL_S" in r.stderr
    r = run(env={"EMS_SERVER_SPIN_US": "busy"})
    assert r.returncode == 2 and "EMS_SERVER_SPIN_US" in r.stderr
    r = run("--spin-us", "-1")
    assert r.returncode == 2 and "spin_us" in r.stderr
    os.chmod(tenants, 0o600)
    r = run("--tenants-file", str(tenants), "--quota", "team-a=1G", "--capacity", "64M")
    assert r.returncode == 2 and "more than capacity" in r.stderr
    assert not (tmp_path / "s" / "ems.sock").exists()


def test_config_file_env_and_flags_in_that_order(tmp_path):
    conf = tmp_path / "ems.toml"
    conf.write_text('capacity = "16M"\nreservation_ttl_s = 5\nlog_level = "debug"\n'
                    'anonymous_quota = "8M"\nspin_us = 50\n')
    env = dict(os.environ, EMS_SERVER_CONFIG=str(conf), EMS_RESERVATION_TTL_S="9",
               EMS_SERVER_SPIN_US="0")
    with run_server(str(tmp_path), capacity="32M", env=env) as server:
        report = server.stats()
        assert report["server"]["capacity_bytes"] == 32 << 20   # flag beats file
        assert report["server"]["reservation_ttl_s"] == 9.0     # env beats file
        assert report["server"]["spin_us"] == 0                 # env beats file
        assert report["tenants"]["(anonymous)"]["capacity_bytes"] == 8 << 20  # file
        assert "DEBUG" in server.log()


def test_stats_command_table_and_json(cc, server):
    option = CcKvOption()
    vals = values_for(["s1", "s2"], 4096)
    cc.save(option, ["s1", "s2"], [v.wrappers() for v in vals])
    out = Value(4096)
    cc.load(option, ["s1"], [out.wrappers()])
    cmd = [sys.executable, "-m", "ems.server", "stats", "--socket-dir", server.socket_dir]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    assert "(anonymous)" in text and "hit rate" in text and "evictions" in text
    assert "capacity 64.0 MiB" in text
    report = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True,
                                       timeout=30, check=True).stdout)
    anon = report["tenants"]["(anonymous)"]
    assert anon["objects"] == 2 and anon["hits"] == 1 and anon["connections"] == 1
    assert report["server"]["connections"] >= 1
    from ems.stats import main as stats_main
    assert stats_main(["--socket-dir", server.socket_dir, "--json"]) == 0
    assert stats_main(["--socket-dir", server.directory + "/nowhere"]) == 1
    # a daemon without --disk has no recovery to wait for: said, not waited for
    with pytest.raises(RuntimeError, match="has no disk tier"):
        server.disk_after_recovery(timeout_s=5)


# ---------------------------------------------------------------- reaching it

def test_init_against_an_absent_daemon_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("EMS_POOL", "server")
    monkeypatch.setenv("EMS_SOCKET_DIR", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert info.value.status_code() is EmsErrorCode.EMS_RECOVERD_ERROR
    assert time.monotonic() - t0 < 1.0
    assert Ems.get_cc() is None and not Ems.check_health()


def test_init_against_a_hung_daemon_fails_within_the_connect_timeout(server, client_env,
                                                                     monkeypatch):
    client_env(server)
    monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "400")
    server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(EmsException) as info:
            Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
        elapsed = time.monotonic() - t0
    finally:
        server.resume()
    assert info.value.status_code() is EmsErrorCode.EMS_RECOVERD_ERROR
    assert 0.3 < elapsed < 2.0
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert Ems.check_health()


def test_a_client_killed_by_signal_is_cleaned_up(server, workers):
    proc = workers.start(server, "slow-save", keys=["k1", "k2"], size=4096)
    workers.wait_line(proc, "copying")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stats = anonymous_stats_when(server, lambda s: s["used_bytes"] == 0, 5.0, "space back")
    assert stats["reserved"] == 0


def test_odd_sizes_stay_apart(cc):
    """Sizes around the 64-byte alignment: nothing overlaps, every byte comes back."""
    option = CcKvOption()
    sizes = [2, 63, 64, 65, 4095, 4097, 100000]
    keys = [f"odd{n}" for n in sizes]
    vals = [Value(n, pattern(k, n)) for k, n in zip(keys, sizes)]
    assert cc.save(option, keys, [v.wrappers() for v in vals]).success == len(keys)
    outs = [Value(n) for n in sizes]
    assert cc.load(option, keys, [o.wrappers() for o in outs]).success == len(keys)
    assert [o.bytes() for o in outs] == [v.bytes() for v in vals]


def test_sigterm_right_after_the_socket_appears_still_stops_cleanly(tmp_path):
    """The socket accepts before the loop starts; a SIGTERM in that window (a supervisor
    stopping a daemon it just started) must still be a clean stop, exit 0 (it was death
    by the signal, -15, in about half of the tries)."""
    for i in range(5):
        sock_dir = tmp_path / f"s{i}"
        proc = subprocess.Popen([sys.executable, "-m", "ems.server", "--socket-dir",
                                 str(sock_dir), "--capacity", "16M"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda d=sock_dir: (d / "ems.sock").exists(), 15.0, "the socket",
                     interval_s=0.001)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        assert not (sock_dir / "ems.sock").exists()
