"""ems-server's control-plane and metrics settings: refusals name the setting, and a
daemon started before its control plane serves once the control plane is up."""

from __future__ import annotations

import signal
import sqlite3

import pytest
from support.control_support import wait_for

from ems.client.remote import RemoteTransport
from ems.control.config import ControlConfig
from ems.errors import EmsErrorCode, EmsException
from ems.server.config import ServerConfig
from ems.testing import run_server


@pytest.mark.parametrize("flags, words", [
    ({"control": "ftp://x"}, "http:// or https://"),
    ({"control": "http://127.0.0.1:1"}, "control_token_file"),
    ({"control": "http://127.0.0.1:1", "control_token_file": "/t", "tenants_file": "/f"},
     "exclude each other"),
    ({"control_poll_s": 0.0}, "control_poll_s"),
    ({"control_poll_s": 120}, "control_poll_s"),
    ({"metrics_addr": "9464"}, "HOST:PORT"),
    ({"metrics_addr": "127.0.0.1:99999"}, "HOST:PORT"),
])
def test_bad_settings_are_refused_naming_the_setting(flags, words):
    with pytest.raises(EmsException) as info:
        ServerConfig.load(flags, {})
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert words in info.value.message()


def test_settings_come_from_the_environment_and_flags_win():
    env = {"EMS_CONTROL": "http://127.0.0.1:8470", "EMS_CONTROL_TOKEN_FILE": "/d.token",
           "EMS_METRICS_ADDR": "127.0.0.1:9464", "EMS_HOST_NAME": "h1"}
    cfg = ServerConfig.load({}, env)
    assert (cfg.control, cfg.control_token_file, cfg.metrics_addr, cfg.host_name) == (
        "http://127.0.0.1:8470", "/d.token", "127.0.0.1:9464", "h1")
    cfg = ServerConfig.load({"metrics_addr": "127.0.0.1:1"}, env)
    assert cfg.metrics_addr == "127.0.0.1:1" and cfg.control_poll_s == 1.0
    assert ServerConfig().control is None and ServerConfig().metrics_addr is None


def test_control_service_settings(tmp_path):
    cfg = ControlConfig.load({"state_dir": str(tmp_path), "port": "0"},
                             {"EMS_CONTROL_DEFAULT_QUOTA": "1G"})
    assert cfg.host == "127.0.0.1" and cfg.port == 0 and cfg.default_quota_bytes == 1 << 30
    assert cfg.file("control.db") == str(tmp_path / "control.db")
    with pytest.raises(EmsException) as info:
        ControlConfig.load({"default_quota_bytes": "2T"}, {})
    assert "default_quota" in info.value.message()
    with pytest.raises(EmsException) as info:
        ControlConfig.load({"port": "http"}, {})
    assert "port" in info.value.message()
    env = {"EMS_CONTROL_ADMIN_TOKEN": "a" * 20, "EMS_CONTROL_DAEMON_TOKEN": "d" * 20}
    cfg = ControlConfig.load({"admin_token": "from-a-flag-is-ignored"}, env)
    assert (cfg.admin_token, cfg.daemon_token) == ("a" * 20, "d" * 20)
    assert "a" * 20 not in repr(cfg)
    with pytest.raises(EmsException) as info:
        ControlConfig.load({}, {"EMS_CONTROL_ADMIN_TOKEN": "short"})
    assert "EMS_CONTROL_ADMIN_TOKEN" in info.value.message()


@pytest.mark.integration
def test_tokens_from_the_environment(tmp_path, monkeypatch):
    from ems.control.client import http_json
    from ems.testing.control import run_control
    monkeypatch.setenv("EMS_CONTROL_ADMIN_TOKEN", "admin-token-from-env-0123")
    monkeypatch.setenv("EMS_CONTROL_DAEMON_TOKEN", "daemon-token-from-env-0123")
    with run_control(str(tmp_path)) as control:
        url = control.url + "/v1/tenants"
        assert http_json("GET", url, "admin-token-from-env-0123")[0] == 200
        assert http_json("GET", url, "daemon-token-from-env-0123")[0] == 401
        assert http_json("GET", control.url + "/v1/registry",
                         "daemon-token-from-env-0123")[0] == 200
        assert not (tmp_path / "admin.token").exists()


@pytest.mark.integration
def test_a_daemon_started_before_its_control_plane_serves_when_it_comes(tmp_path, daemons):
    from ems.testing.control import ControlProcess
    cdir = tmp_path / "control"
    cdir.mkdir()
    control = ControlProcess(str(cdir))
    control.start()  # once, to make its tokens and learn a port
    control.stop()
    server = daemons.start(control, "early", extra=("--anonymous-quota", "8M"),
                           anonymous=True)
    try:
        wait_for(lambda: "unreachable" in server.log(), 5.0, "the daemon to notice")
        anon = RemoteTransport.connect(server.socket_path, None, None, 3.0)  # serves
        anon.close()
        control.start()
        _, t = control.call("POST", "/v1/tenants", {"access_id": "team-a", "quota": "8M",
                                                    "issue_key": True})

        def joined():
            try:
                RemoteTransport.connect(server.socket_path, "team-a",
                                        t["key"]["access_key"], 3.0).close()
                return True
            except EmsException:
                return False
        wait_for(joined, 8.0, "the tenant after the control plane came up")
    finally:
        control.stop()


@pytest.mark.integration
def test_an_unreadable_daemon_token_file_stops_the_daemon(tmp_path):
    token = tmp_path / "daemon.token"
    token.write_text("x" * 40)
    token.chmod(0o644)
    with run_server(str(tmp_path), capacity="16M", start=False, extra_args=[
            "--control", "http://127.0.0.1:1", "--control-token-file", str(token)]) as server:
        with pytest.raises(RuntimeError, match="exited with 2"):
            server.start()
        assert "chmod 600" in server.log()


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_ems_control_stops_with_status_0_on_a_stop_signal(tmp_path, signum):
    """The documented exit status: 0 after SIGTERM or SIGINT, with its cleanup run
    (uvicorn re-raises the signal after its graceful shutdown; under the default
    handler that was -15, and the "stopped" line never came)."""
    from ems.testing.control import ControlProcess
    control = ControlProcess(str(tmp_path)).start()
    try:
        assert control.call("GET", "/v1/tenants")[0] == 200
        assert control.signal(signum) == 0, control.log()
    finally:
        control.stop()
    assert f"ems-control stopped ({signum.name})" in control.log()
    db = sqlite3.connect(tmp_path / "control.db")  # closed cleanly: WAL checkpointed
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        db.close()
    assert not (tmp_path / "control.db-wal").exists() or \
        (tmp_path / "control.db-wal").stat().st_size == 0
