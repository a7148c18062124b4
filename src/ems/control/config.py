"""Settings of ``ems-control``: defaults < environment < flags.

Each setting is declared once below (``ems.settings``); the flags, the merge and the
settings table of docs/control-plane.md are made from those declarations.

The two tokens themselves can come from the environment instead of their files
(never from flags, which every user sees in ``ps``); at least 16 characters each.

The files default to ``control.db``, ``master.key``, ``admin.token`` and
``daemon.token`` in the state directory (default ``~/.local/state/ems-control``,
created 0700); on first start the service creates the key and the two tokens
(random, mode 0600). It listens on 127.0.0.1:8470 unless told otherwise: the admin
token is a bearer token over plain HTTP, so put TLS (a reverse proxy) in front before
listening on another address.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping, Optional

from ems.errors import invalid
from ems.settings import Choice, Integer, Layer, Size, Text, add_flags, check_fields, load, setting

__all__ = ["ControlConfig", "DEFAULT_PORT"]

DEFAULT_PORT = 8470
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".local", "state")
    return os.path.join(base, "ems-control")


def _token(raw: Any, where: str) -> str:
    text = Text()(raw, where).strip()
    if len(text) < 16:
        raise invalid(f"{where} must have at least 16 characters, got {len(text)}")
    return text


def _setting(doc: str, parse: Any, **kw: Any) -> Any:
    """A setting of the environment and the flags (the service reads no file)."""
    return setting(doc, parse, key=None, **kw)


def _file(doc: str, flag: str, env: str) -> Any:
    return _setting(doc, Text(), default=None, env=env, flag=flag, metavar="FILE",
                   shown="STATE_DIR/" + doc.split()[0].rstrip(":"))


@dataclasses.dataclass(frozen=True)
class ControlConfig:
    """The service's settings (see the module docstring)."""

    state_dir: str = _setting(
        "directory of the database, key and token files (made 0700)", Text(),
        default_factory=_default_state_dir, shown="~/.local/state/ems-control",
        env="EMS_CONTROL_STATE_DIR", flag="--state-dir", metavar="DIR")
    db_path: Optional[str] = _file("control.db: the SQLite database", "--db",
                                   "EMS_CONTROL_DB")
    master_key_file: Optional[str] = _file(
        "master.key: the key sealing access keys at rest (made 0600 when missing)",
        "--master-key-file", "EMS_CONTROL_MASTER_KEY_FILE")
    admin_token_file: Optional[str] = _file(
        "admin.token: bearer token of the admin API (made 0600 when missing)",
        "--admin-token-file", "EMS_CONTROL_ADMIN_TOKEN_FILE")
    daemon_token_file: Optional[str] = _file(
        "daemon.token: bearer token of the daemons (made 0600 when missing)",
        "--daemon-token-file", "EMS_CONTROL_DAEMON_TOKEN_FILE")
    host: str = _setting("address to listen on (plain HTTP: put TLS in front elsewhere)",
                        Text(), default="127.0.0.1", env="EMS_CONTROL_HOST", flag="--host")
    port: int = _setting("port to listen on (0: any free one, see --port-file)",
                        Integer(0, 65535), default=DEFAULT_PORT, env="EMS_CONTROL_PORT",
                        flag="--port")
    default_quota_bytes: int = _setting(
        "pool size of a tenant created without one", Size(), default=256 << 20,
        env="EMS_CONTROL_DEFAULT_QUOTA", flag="--default-quota", dest="default_quota_bytes",
        metavar="SIZE")
    max_quota_bytes: int = _setting(
        "the largest quota the service accepts", Size(), default=1 << 40,
        env="EMS_CONTROL_MAX_QUOTA", flag="--max-quota", dest="max_quota_bytes",
        metavar="SIZE")
    log_level: str = _setting("DEBUG, INFO, WARNING or ERROR", Choice(_LEVELS, fold="upper"),
                             default="INFO", env="EMS_LOG_LEVEL", flag="--log-level")
    port_file: Optional[str] = _setting(
        "write the port listened on to this file once listening (tests use port 0)",
        Text(), default=None, flag="--port-file", metavar="FILE")
    admin_token: Optional[str] = _setting(
        "the admin token itself, instead of its file (never a flag: ps shows those)",
        _token, default=None, env="EMS_CONTROL_ADMIN_TOKEN", repr=False)
    daemon_token: Optional[str] = _setting(
        "the daemon token itself, instead of its file", _token, default=None,
        env="EMS_CONTROL_DAEMON_TOKEN", repr=False)

    def __post_init__(self) -> None:
        check_fields(self)
        if not (1 << 20) <= self.default_quota_bytes <= self.max_quota_bytes:
            raise invalid(f"default_quota must be in 1 MiB..max_quota "
                          f"({self.max_quota_bytes}), got {self.default_quota_bytes}")

    def file(self, name: str) -> str:
        """The path of one of the state files (its own setting, else in state_dir)."""
        given = {"control.db": self.db_path, "master.key": self.master_key_file,
                 "admin.token": self.admin_token_file,
                 "daemon.token": self.daemon_token_file}[name]
        return given or os.path.join(self.state_dir, name)

    @classmethod
    def load(cls, flags: Mapping[str, Any], env: Mapping[str, str]) -> "ControlConfig":
        """Merge the environment and ``flags`` (argparse values; None: not given)."""
        return load(cls, [Layer.environ(env), Layer.flags(flags)])

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        """One flag per declared setting."""
        add_flags(parser, ControlConfig)
