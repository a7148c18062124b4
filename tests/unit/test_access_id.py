"""One rule for a tenant's access_id (``ems.config.validate_access_id``), applied by the
SDK, the daemon's tenants file, the control plane's API and the registry a daemon
fetches."""

from __future__ import annotations

import inspect
import os

import pytest

from ems.config import EmsConfig, validate_access_id, validate_access_key, validate_ems_config
from ems.errors import EmsErrorCode, EmsException
from ems.server import config as server_config
from ems.server import tenants as server_tenants

KEY = "A" * 32
GOOD = ["team-a", "org/Model:v2", "cc_kvstore@_@ds_default_ns_001", "Équipe A", "x" * 512]
BAD = ["", "a\nb", "tab\there", "x" * 513, "\ud800", 7, None, b"bytes"]


@pytest.mark.parametrize("ident", GOOD)
def test_a_valid_access_id_passes_everywhere(ident, tmp_path):
    assert validate_access_id(ident) == ident
    validate_ems_config(EmsConfig(access_id=ident, access_key=KEY))
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants]\n"{ident}" = "{KEY}"\n')
    os.chmod(path, 0o600)
    assert server_tenants.load_tenants(str(path)) == {ident: KEY}


@pytest.mark.parametrize("ident", BAD, ids=repr)
def test_an_invalid_access_id_is_refused_by_the_sdk_and_the_daemon(ident, tmp_path):
    with pytest.raises(EmsException) as one:
        validate_access_id(ident)
    assert one.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "access_id" in one.value.message()
    with pytest.raises(EmsException) as sdk:
        validate_ems_config(EmsConfig(access_id=ident, access_key=KEY))
    if ident is not None:  # None with a key: "access_key needs an access_id"
        assert sdk.value.message() == one.value.message()
    if isinstance(ident, str) and "\ud800" not in ident:  # what TOML can hold
        path = tmp_path / "tenants.toml"
        path.write_text(f"[tenants]\n{_toml_str(ident)} = \"{KEY}\"\n")
        os.chmod(path, 0o600)
        with pytest.raises(EmsException) as daemon:
            server_tenants.load_tenants(str(path))
        assert one.value.message() in daemon.value.message()


def _toml_str(s: str) -> str:
    return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}"
                         for c in s) + '"'


@pytest.mark.parametrize("key", ["", "short", "A" * 31, "A" * 257, "bad key " * 5, 42])
def test_a_tenants_file_key_follows_the_sdk_rule(key, tmp_path):
    with pytest.raises(EmsException):
        validate_access_key(key)
    path = tmp_path / "tenants.toml"
    value = f'"{key}"' if isinstance(key, str) else str(key)
    path.write_text(f"[tenants]\nteam-a = {value}\n")
    os.chmod(path, 0o600)
    with pytest.raises(EmsException, match="team-a"):
        server_tenants.load_tenants(str(path))


def test_the_three_places_call_the_one_rule_and_build_no_config():
    from ems.server import control_sync
    modules = [server_config, control_sync]
    try:
        from ems.control import app
        modules.append(app)
    except ImportError:  # the control extra is not installed
        pass
    for module in modules:
        source = inspect.getsource(module)
        assert "validate_access_id(" in source, module.__name__
        assert "EmsConfig(" not in source, module.__name__
