"""The deployment examples of docs/operations.md are valid: the Kubernetes manifest's
ConfigMap is a config ems-server accepts, its commands name ems's own programs and
flags, and the systemd unit starts ems-server with flags it parses."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest

from ems.server.__main__ import _parser
from ems.server.config import ServerConfig

yaml = pytest.importorskip("yaml")  # PyYAML comes with mkdocs (the test extra)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _manifests() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "kubernetes" / "ems-server.yaml").read_text()))


def test_the_configmap_is_a_config_ems_server_accepts(tmp_path):
    config_map = next(d for d in _manifests() if d["kind"] == "ConfigMap")
    path = tmp_path / "ems-server.toml"
    path.write_text(config_map["data"]["ems-server.toml"])
    config = ServerConfig.load({"config": str(path)}, {})
    assert config.socket_dir == "/run/ems" and config.socket_mode == 0o660
    assert config.capacity_bytes == 16 << 30


def test_the_daemonset_and_the_pod_share_the_socket_directory():
    docs = _manifests()
    ds = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    pod = next(d for d in docs if d["kind"] == "Pod")["spec"]
    (server,) = ds["containers"]
    args = _parser().parse_args(server["command"][1:])
    assert server["command"][0] == "ems-server" and args.config == "/etc/ems/ems-server.toml"

    def host_path(spec: dict, container: dict) -> tuple[str, str]:
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "socket-dir"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "socket-dir"]
        return vol["hostPath"]["path"], mount["mountPath"]

    assert host_path(ds, server) == host_path(pod, pod["containers"][0]) == ("/run/ems",
                                                                             "/run/ems")
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env == {"EMS_SOCKET_DIR": "/run/ems", "EMS_POOL": "server"}
    limit = ds["containers"][0]["resources"]["limits"]["memory"]
    assert int(limit.removesuffix("Gi")) << 30 > 16 << 30  # the pool and the process


def test_the_systemd_unit_starts_ems_server_with_flags_it_parses():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "ems-server.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/ems-server")
    assert _parser().parse_args(argv[1:]).config == "/etc/ems/ems-server.toml"
    assert service["Environment"] == "EMS_SOCKET_DIR=/run/ems"
    assert service["RuntimeDirectory"] == "ems"
    assert service["RestartPreventExitStatus"] == "2"  # the daemon's bad-configuration exit
