"""Settings of ``ems-control``: defaults < environment < flags.

=====================  ==========================  ===============================
setting                flag                        environment
=====================  ==========================  ===============================
state directory        ``--state-dir``             ``EMS_CONTROL_STATE_DIR``
database               ``--db``                    ``EMS_CONTROL_DB``
master key file        ``--master-key-file``       ``EMS_CONTROL_MASTER_KEY_FILE``
admin token file       ``--admin-token-file``      ``EMS_CONTROL_ADMIN_TOKEN_FILE``
daemon token file      ``--daemon-token-file``     ``EMS_CONTROL_DAEMON_TOKEN_FILE``
listen address         ``--host`` / ``--port``     ``EMS_CONTROL_HOST`` / ``_PORT``
default quota          ``--default-quota``         ``EMS_CONTROL_DEFAULT_QUOTA``
largest quota          ``--max-quota``             ``EMS_CONTROL_MAX_QUOTA``
log level              ``--log-level``             ``EMS_LOG_LEVEL``
admin token itself     -                           ``EMS_CONTROL_ADMIN_TOKEN``
daemon token itself    -                           ``EMS_CONTROL_DAEMON_TOKEN``
=====================  ==========================  ===============================

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

import dataclasses
import os
from typing import Any, Mapping, Optional

from ems.config import parse_bytes
from ems.errors import invalid

__all__ = ["ControlConfig", "DEFAULT_PORT"]

DEFAULT_PORT = 8470
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".local", "state")
    return os.path.join(base, "ems-control")


@dataclasses.dataclass(frozen=True)
class ControlConfig:
    """The service's settings (see the module docstring)."""

    state_dir: str = dataclasses.field(default_factory=_default_state_dir)
    db_path: Optional[str] = None
    master_key_file: Optional[str] = None
    admin_token_file: Optional[str] = None
    daemon_token_file: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    #: pool size of a tenant created without one, bytes
    default_quota_bytes: int = 256 << 20
    #: the largest quota the service accepts, bytes
    max_quota_bytes: int = 1 << 40
    log_level: str = "INFO"
    #: write the port listened on here once listening (tests use port 0)
    port_file: Optional[str] = None
    #: the tokens themselves (environment only); None: read from their files
    admin_token: Optional[str] = dataclasses.field(default=None, repr=False)
    daemon_token: Optional[str] = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise invalid(f"port must be in 0..65535, got {self.port}")
        if not (1 << 20) <= self.default_quota_bytes <= self.max_quota_bytes:
            raise invalid(f"default_quota must be in 1 MiB..max_quota "
                          f"({self.max_quota_bytes}), got {self.default_quota_bytes}")
        for name in ("admin_token", "daemon_token"):
            value = getattr(self, name)
            if value is not None and len(value.strip()) < 16:
                raise invalid(f"{name} (EMS_CONTROL_{name.upper()}) must have at least 16 "
                              f"characters, got {len(value.strip())}")
        if self.log_level not in _LEVELS:
            raise invalid(f"log_level must be one of {', '.join(_LEVELS)}, got "
                          f"{self.log_level!r}")

    def file(self, name: str) -> str:
        """The path of one of the state files (its own setting, else in state_dir)."""
        given = {"control.db": self.db_path, "master.key": self.master_key_file,
                 "admin.token": self.admin_token_file,
                 "daemon.token": self.daemon_token_file}[name]
        return given or os.path.join(self.state_dir, name)

    @classmethod
    def load(cls, flags: Mapping[str, Any], env: Mapping[str, str]) -> "ControlConfig":
        kw: dict[str, Any] = {}
        for key, var in (("state_dir", "EMS_CONTROL_STATE_DIR"), ("db_path", "EMS_CONTROL_DB"),
                         ("master_key_file", "EMS_CONTROL_MASTER_KEY_FILE"),
                         ("admin_token_file", "EMS_CONTROL_ADMIN_TOKEN_FILE"),
                         ("daemon_token_file", "EMS_CONTROL_DAEMON_TOKEN_FILE"),
                         ("host", "EMS_CONTROL_HOST"), ("port", "EMS_CONTROL_PORT"),
                         ("default_quota_bytes", "EMS_CONTROL_DEFAULT_QUOTA"),
                         ("max_quota_bytes", "EMS_CONTROL_MAX_QUOTA"),
                         ("log_level", "EMS_LOG_LEVEL"), ("port_file", None),
                         ("admin_token", "EMS_CONTROL_ADMIN_TOKEN"),
                         ("daemon_token", "EMS_CONTROL_DAEMON_TOKEN")):
            value = flags.get(key)
            if key.endswith("_token") and var is not None:  # never from a flag
                value = (env.get(var) or "").strip() or None
            elif value is None and var is not None:
                value = env.get(var) or None
            if value is None:
                continue
            if key == "port":
                try:
                    value = int(value)
                except ValueError:
                    raise invalid(f"port must be an int, got {value!r}") from None
            elif key.endswith("_bytes"):
                value = parse_bytes(value, key[:-6])
            elif key == "log_level":
                value = str(value).upper()
            kw[key] = value
        return cls(**kw)
