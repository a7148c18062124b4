"""Configuration of ``ems-server``: defaults < config file < environment < flags.

Every setting, its flag, its config-file key and its environment variable:

=====================  ======================  ======================  ====================
setting                flag                    config file (TOML)      environment
=====================  ======================  ======================  ====================
socket directory       ``--socket-dir``        ``socket_dir``          ``EMS_SOCKET_DIR``
total capacity         ``--capacity``          ``capacity``            ``EMS_SERVER_CAPACITY``
tenants file           ``--tenants-file``      ``tenants_file``        ``EMS_TENANTS_FILE``
anonymous access       ``--[no-]anonymous``    ``anonymous``           ``EMS_ANONYMOUS``
anonymous quota        ``--anonymous-quota``   ``anonymous_quota``     -
per-tenant quotas      ``--quota ID=SIZE``     ``[quotas]`` ID = SIZE  -
reservation TTL        ``--reservation-ttl-s`` ``reservation_ttl_s``   ``EMS_RESERVATION_TTL_S``
socket permissions     ``--socket-mode``       ``socket_mode``         -
log level              ``--log-level``         ``log_level``           ``EMS_LOG_LEVEL``
busy-poll window       ``--spin-us``           ``spin_us``             ``EMS_SERVER_SPIN_US``
cluster (shared tier)  ``--cluster``           ``cluster``             ``EMS_CLUSTER``
cluster TLS CA file    ``--cluster-ca-file``   ``cluster_ca_file``     ``EMS_CLUSTER_CA_FILE``
cluster TLS client     ``--cluster-cert-file`` ``cluster_cert_file``   ``EMS_CLUSTER_CERT_FILE``
certificate and key    ``--cluster-key-file``  ``cluster_key_file``    ``EMS_CLUSTER_KEY_FILE``
cluster password       -                       -                       ``EMS_CLUSTER_PASSWORD``
write-behind bound     ``--cluster-write-      ``cluster_write_        -
                       behind``                behind``
disk tier directory    ``--disk``              ``[disk]`` ``path``     ``EMS_DISK``
disk tier capacity     ``--disk-capacity``     ``[disk]`` ``capacity`` ``EMS_DISK_CAPACITY``
index checkpoint every ``--disk-checkpoint-s`` ``[disk]``              ``EMS_DISK_CHECKPOINT_S``
                                               ``checkpoint_s``
disk admission         ``--disk-admission``    ``[disk]`` ``admission`` -
other disk settings    -                       ``[disk]`` (:class:`DiskConfig`) -
control plane URL      ``--control``           ``control``             ``EMS_CONTROL``
its daemon token file  ``--control-token-file`` ``control_token_file`` ``EMS_CONTROL_TOKEN_FILE``
registry poll period   ``--control-poll-s``    ``control_poll_s``      -
last registry on disk  ``--control-cache``     ``control_cache``       -
host name reported     ``--host-name``         ``host_name``           ``EMS_HOST_NAME``
Prometheus exporter    ``--metrics-addr``      ``metrics_addr``        ``EMS_METRICS_ADDR``
KV events (ZMQ PUB)    ``--kv-events``         ``kv_events``           ``EMS_KV_EVENTS``
their replay (ROUTER)  ``--kv-events-replay``  ``kv_events_replay``    ``EMS_KV_EVENTS_REPLAY``
limits (:class:`Limits`) ``--limit NAME=VALUE`` ``[limits]`` NAME = V  -
=====================  ======================  ======================  ====================

With ``control`` set, tenants come from ``ems-control`` (``ems.server.control_sync``,
docs/control-plane.md) and the tenants file must not be given; ``metrics_addr``
(``127.0.0.1:9464``) turns on the Prometheus exporter (``ems.server.metrics``);
``kv_events`` (``tcp://HOST:PORT``, off by default) publishes what the pool stores and
evicts in vLLM's KV-events format (``ems.server.kv_events``; needs ``pyzmq``:
``pip install 'ems[events]'``), with ``kv_events_replay`` its replay endpoint.

The cluster: ``valkey://[user:password@]HOST:PORT[,HOST:PORT...]`` (``valkeys://``:
TLS) joins the daemon to a Valkey Cluster that holds the pool shared by every host
(``ems.server.cluster_tier``, docs/tiers/cluster.md). Its credentials stay in the daemon;
prefer ``EMS_CLUSTER_PASSWORD`` to a password in the URL (which ``ps`` shows).

The busy-poll window: after serving a request, the event loop polls without sleeping
for ``spin_us`` microseconds (default 200; 0: sleep at once), yielding the CPU to any
other runnable thread between polls. A request that arrives in the window is served
without a wake-up of a sleeping process (on a VM, ~10-20 us of a ~100 us 1-key round
trip: the sleeping vCPU halts, and its caches are cold after the wake-up). An idle
daemon sleeps; a busy one uses up to one CPU while it spins.

The disk tier (``--disk DIR``, ``ems.server.disk_tier``): objects of shared memory are
also kept in region files under ``DIR``, up to ``capacity``, and loaded back from there
when shared memory misses them, also after a restart or a crash (the docs' tiers page
says what survives what). Off by default.

The config file is ``--config FILE`` or ``EMS_SERVER_CONFIG``. Sizes are bytes or
``512M``/``4G`` (binary units). Unknown keys and bad values stop the daemon with a
message naming them (fail closed).

Capacity and quotas: ``capacity`` bounds the memory of the whole daemon. Each tenant
(and the anonymous namespace, when enabled) gets its own pool: its quota when one is
configured, else an equal share of what the explicit quotas leave. Quotas that add up
to more than ``capacity`` are refused.

The tenants file holds secrets (``[tenants]`` table of ``access_id = "access_key"``)
and must not be readable by group or others (``chmod 600``); see :func:`load_tenants`.

(The style guide keeps ``EMS_*`` reads in ``ems.config``; the daemon's own variables
are read here, from the mapping ``main`` passes in, because nothing in the SDK uses
them and the daemon must not depend on the SDK's client settings.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from typing import Any, Mapping, Optional

from ems.config import PoolSettings, parse_bytes, validate_access_id, validate_access_key
from ems.errors import EmsException, invalid

__all__ = ["ANONYMOUS", "SDK_MAX_KEY_BYTES", "DiskConfig", "Limits", "ServerConfig",
           "TenantSpec",
           "configure_logging", "load_tenants", "read_toml", "resolve_quotas"]

ANONYMOUS = "(anonymous)"  # display name; refused as an access_id (_check_id)
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_FILE_KEYS = {"socket_dir", "capacity", "tenants_file", "anonymous", "anonymous_quota",
              "quotas", "reservation_ttl_s", "socket_mode", "log_level", "spin_us",
              "control", "control_token_file", "control_poll_s", "control_cache", "host_name",
              "metrics_addr", "kv_events", "kv_events_replay", "limits", "cluster",
              "cluster_ca_file", "cluster_cert_file", "cluster_key_file", "cluster_write_behind",
              "disk"}
#: The longest storage key the SDK makes: a PrimaryKey of two 127-character parts of
#: 4-byte UTF-8 characters, and its ``v0:p:127:`` prefix (V1 keys are ~50 bytes).
SDK_MAX_KEY_BYTES = 2 * 127 * 4 + 16


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds that keep one local process (any user who can reach the socket) from
    hurting the others. Each has a default, a ``[limits]`` key in the config file and
    ``--limit NAME=VALUE``, a refusal the client understands, and a counter in
    ``ems stats`` (``server.refused``):

    ==========================  ========  ==============================================
    limit                       default   over it
    ==========================  ========  ==============================================
    max_keys_per_request        4096      the request is refused (EMS_INVALID_ARGUMENT);
                                          the SDK splits larger calls into such slices
    max_key_bytes               1032      refused (EMS_INVALID_ARGUMENT); the SDK's own
                                          key rule never makes a longer key
    max_pins_per_connection     65536     the Acquire pins what fits: later keys miss
    max_frame_bytes             8 MiB     the connection is closed (EMS_PROTOCOL_ERROR)
    max_buffered_bytes          64 MiB    partial frames of all connections together:
                                          the connection that goes over is closed
    max_connections_per_uid     256       refused at accept (EMS_RECOVERD_ERROR)
    max_connections_per_tenant  1024      refused at hello (EMS_RECOVERD_ERROR); the
                                          anonymous namespace counts as one tenant
    max_leases_per_connection   4         no lease (small saves take reserve/commit)
    lease_share                 0.25      of a tenant's pool all leases may hold; over
                                          it: no lease
    handshake_timeout_s         10        a connection that has not finished its
                                          handshake by then is closed
    ==========================  ========  ==============================================

    A request is handled inline by the event loop: at ~2-3 us per key, 4096 keys keep
    other connections waiting ~10 ms at most (300k keys in one frame stalled them for
    0.5-1.3 s before these limits existed).
    """

    max_keys_per_request: int = 4096
    max_key_bytes: int = SDK_MAX_KEY_BYTES
    max_pins_per_connection: int = 65536
    max_frame_bytes: int = 8 << 20
    max_buffered_bytes: int = 64 << 20
    max_connections_per_uid: int = 256
    max_connections_per_tenant: int = 1024
    max_leases_per_connection: int = 4
    lease_share: float = 0.25
    handshake_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", float):
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and 0 < value and (value <= 1 or f.name != "lease_share"))
                rule = "a number in (0, 1]" if f.name == "lease_share" else "a number > 0"
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
                rule = "an int > 0"
            if not ok:
                raise invalid(f"limits.{f.name} must be {rule}, got {value!r}")
        if self.max_key_bytes < SDK_MAX_KEY_BYTES:
            raise invalid(f"limits.max_key_bytes must be >= {SDK_MAX_KEY_BYTES} (the "
                          f"longest key the SDK makes), got {self.max_key_bytes}")
        need = self.max_keys_per_request * (self.max_key_bytes + 16) + 4096
        if self.max_frame_bytes < need:
            raise invalid(f"limits.max_frame_bytes must hold a request of "
                          f"max_keys_per_request keys of max_key_bytes ({need} bytes), "
                          f"got {self.max_frame_bytes}")
        if self.max_buffered_bytes < self.max_frame_bytes:
            raise invalid("limits.max_buffered_bytes must be >= limits.max_frame_bytes")

    @classmethod
    def parse(cls, items: Mapping[str, Any], where: str) -> "Limits":
        """From a ``[limits]`` table or ``--limit`` pairs (sizes may be ``8M``)."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for name, raw in items.items():
            f = names.get(name)
            if f is None:
                raise invalid(f"{where}: unknown limit {name!r}; known: "
                              f"{', '.join(sorted(names))}")
            if f.type in ("float", float):
                try:
                    kw[name] = float(raw)
                except (TypeError, ValueError):
                    raise invalid(f"{where}: limits.{name} must be a number, got "
                                  f"{raw!r}") from None
            elif name.endswith("_bytes"):
                kw[name] = parse_bytes(raw, f"limits.{name}")
            else:
                try:
                    kw[name] = int(raw)
                except (TypeError, ValueError):
                    raise invalid(f"{where}: limits.{name} must be an int, got "
                                  f"{raw!r}") from None
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class DiskConfig:
    """The disk tier (``[disk]`` in the config file; ``--disk DIR`` turns it on).

    =====================  ==========  ==============================================
    key                    default     what
    =====================  ==========  ==============================================
    path                   -           directory of the region files (0700, made)
    capacity               64G         bytes of records at most (all tenants); more
                                       than the filesystem is allowed (warned)
    checkpoint_s           10          the index is checkpointed this often, seconds
    admission              all         ``all``: every object saved goes to disk;
                                       ``second-hit``: only objects saved again or
                                       loaded from shared memory (hot ones)
    write_budget           none        bytes written per day at most (SSD wear);
                                       past it, nothing is admitted until the next
                                       day's budget (counted)
    flush_on_stop_s        30          on SIGTERM, write what shared memory holds and
                                       the disk does not, for at most this long
    io_threads             4           worker threads (the disk's queue depth)
    inflight               64M         bytes of writes in flight at most
    queue                  1G          bytes of writes waiting at most (past it a
                                       save is not written to disk: counted)
    [disk.quotas] ID=SIZE  a share     a tenant's disk bytes (default: its share of
                                       the pool's capacity, of the disk's)
    io_delay_ms            0           fault testing only: every read and write of
                                       the disk waits this long first
    =====================  ==========  ==============================================
    """

    path: str
    capacity_bytes: int = 64 << 30
    checkpoint_s: float = 10.0
    admission: str = "all"
    write_budget_bytes_per_day: Optional[int] = None
    flush_on_stop_s: float = 30.0
    io_threads: int = 4
    inflight_bytes: int = 64 << 20
    queue_bytes: int = 1 << 30
    quotas_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    io_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.path:
            raise invalid("disk.path must not be empty")
        if self.capacity_bytes <= 0:
            raise invalid(f"disk.capacity must be > 0, got {self.capacity_bytes}")
        for name in ("checkpoint_s", "flush_on_stop_s", "io_delay_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                    or value > 86400:
                raise invalid(f"disk.{name} must be a number in 0..86400, got {value!r}")
        if self.checkpoint_s < 0.05:
            raise invalid(f"disk.checkpoint_s must be >= 0.05, got {self.checkpoint_s}")
        if self.admission not in _ADMISSIONS:
            raise invalid(f"disk.admission must be one of {', '.join(_ADMISSIONS)}, got "
                          f"{self.admission!r}")
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) or \
                not 1 <= self.io_threads <= 64:
            raise invalid(f"disk.io_threads must be an int in 1..64, got {self.io_threads!r}")
        for name in ("inflight_bytes", "queue_bytes"):
            if getattr(self, name) <= 0:
                raise invalid(f"disk.{name.replace('_bytes', '')} must be > 0, got "
                              f"{getattr(self, name)}")
        if self.write_budget_bytes_per_day is not None and self.write_budget_bytes_per_day <= 0:
            raise invalid(f"disk.write_budget must be > 0, got "
                          f"{self.write_budget_bytes_per_day}")
        for ident in self.quotas_bytes:
            if ident != ANONYMOUS:
                _check_id(ident, "disk.quotas")

    @classmethod
    def parse(cls, items: Mapping[str, Any]) -> "DiskConfig":
        """From a ``[disk]`` table (and the flags/environment merged into it)."""
        unknown = sorted(set(items) - _DISK_KEYS)
        if unknown:
            raise invalid(f"disk: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(_DISK_KEYS))}")
        if "path" not in items:
            raise invalid("disk needs path (the directory of the disk tier: --disk DIR)")
        kw: dict[str, Any] = {"path": _str(items["path"], "disk.path")}
        if "capacity" in items:
            kw["capacity_bytes"] = parse_bytes(items["capacity"], "disk.capacity")
        for key in ("checkpoint_s", "flush_on_stop_s", "io_delay_ms"):
            if key in items:
                kw[key] = _number(items[key], f"disk.{key}")
        if "admission" in items:
            kw["admission"] = _str(items["admission"], "disk.admission")
        if "write_budget" in items:
            kw["write_budget_bytes_per_day"] = parse_bytes(items["write_budget"],
                                                           "disk.write_budget")
        if "io_threads" in items:
            kw["io_threads"] = items["io_threads"]
        if "inflight" in items:
            kw["inflight_bytes"] = parse_bytes(items["inflight"], "disk.inflight")
        if "queue" in items:
            kw["queue_bytes"] = parse_bytes(items["queue"], "disk.queue")
        quotas = items.get("quotas", {})
        if not isinstance(quotas, dict):
            raise invalid("disk.quotas must be a table of access_id = size")
        kw["quotas_bytes"] = {k: parse_bytes(v, f"disk.quotas.{k}") for k, v in quotas.items()}
        return cls(**kw)


_ADMISSIONS = ("all", "second-hit")
_DISK_KEYS = {"path", "capacity", "checkpoint_s", "admission", "write_budget",
              "flush_on_stop_s", "io_threads", "inflight", "queue", "quotas", "io_delay_ms"}


def _number(value: Any, field: str) -> float:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise invalid(f"{field} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{field} must be a number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The daemon's settings (see the module docstring for where each comes from)."""

    #: directory of ``ems.sock`` (shared with the inference processes; the SDK's
    #: default, ``/dev/shm/ems``)
    socket_dir: str = PoolSettings.socket_dir
    #: memory of all pools together, bytes (default: min(4 GiB, RAM/4))
    capacity_bytes: int = dataclasses.field(
        default_factory=lambda: PoolSettings().capacity_bytes)
    #: TOML file of ``access_id = "access_key"`` pairs; None = no tenants
    tenants_file: Optional[str] = None
    #: allow clients without access_id/access_key (their own namespace)
    anonymous: bool = True
    #: pool size of the anonymous namespace, bytes (None: an equal share)
    anonymous_quota_bytes: Optional[int] = None
    #: pool size per access_id, bytes (others: an equal share)
    quotas_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: a writer's reservation is freed this long after it was made
    reservation_ttl_s: float = 60.0
    #: permissions of the socket file (the directory's still apply)
    socket_mode: int = 0o660
    log_level: str = "INFO"
    #: busy-poll this long after a request before sleeping (0: never)
    spin_us: int = 200
    #: URL of ems-control (tenants, keys, quotas from there); None: the tenants file
    control: Optional[str] = None
    #: file holding the daemon token of ems-control (mode 0600)
    control_token_file: Optional[str] = None
    #: fetch the registry (and report) this often, seconds
    control_poll_s: float = 1.0
    #: file (0600) keeping the last registry (keys sealed by the daemon token) for a
    #: restart while the control plane is down; None: memory only
    control_cache: Optional[str] = None
    #: this daemon's name on the control plane (default: hostname:socket_dir)
    host_name: Optional[str] = None
    #: ``HOST:PORT`` of the Prometheus exporter; None: off
    metrics_addr: Optional[str] = None
    #: ``tcp://HOST:PORT`` the KV events' ZMQ PUB socket binds (port 0: any); None: off
    kv_events: Optional[str] = None
    #: ``tcp://HOST:PORT`` of their replay ROUTER socket; None: no replay
    kv_events_replay: Optional[str] = None
    #: the Valkey Cluster of the shared tier (None: this host only)
    cluster: Optional[str] = dataclasses.field(default=None, repr=False)
    cluster_ca_file: Optional[str] = None
    cluster_cert_file: Optional[str] = None
    cluster_key_file: Optional[str] = None
    cluster_password: Optional[str] = dataclasses.field(default=None, repr=False)
    #: bytes of write-behind in flight at most (past it, a save stays local only)
    cluster_write_behind_bytes: int = 256 << 20
    #: bounds on what one client may hold or send (see :class:`Limits`)
    limits: Limits = dataclasses.field(default_factory=Limits)
    #: the disk tier (None: off)
    disk: Optional[DiskConfig] = None

    def __post_init__(self) -> None:
        if not self.socket_dir:
            raise invalid("socket_dir must not be empty")
        if self.capacity_bytes <= 0:
            raise invalid(f"capacity must be > 0, got {self.capacity_bytes}")
        if not 0 < self.reservation_ttl_s <= 86400:
            raise invalid(f"reservation_ttl_s must be in (0, 86400], got "
                          f"{self.reservation_ttl_s}")
        if not 0 <= self.socket_mode <= 0o777:
            raise invalid(f"socket_mode must be an octal permission like 0660, got "
                          f"{self.socket_mode:o}")
        if self.log_level not in _LEVELS:
            raise invalid(f"log_level must be one of {', '.join(_LEVELS)}, got "
                          f"{self.log_level!r}")
        if isinstance(self.spin_us, bool) or not isinstance(self.spin_us, int) or not (
                0 <= self.spin_us <= 1_000_000):
            raise invalid(f"spin_us must be an int in 0..1000000, got {self.spin_us!r}")
        for ident in self.quotas_bytes:
            _check_id(ident, "quotas")
        if self.control is not None:
            if not self.control.startswith(("http://", "https://")):
                raise invalid(f"control must be an http:// or https:// URL, got "
                              f"{self.control!r}")
            if self.control_token_file is None:
                raise invalid("control needs control_token_file (the daemon token of "
                              "ems-control)")
            if self.tenants_file is not None:
                raise invalid("control and tenants_file exclude each other: with a "
                              "control plane, tenants come from it")
        if isinstance(self.control_poll_s, bool) or not isinstance(
                self.control_poll_s, (int, float)) or not 0.05 <= self.control_poll_s <= 60:
            raise invalid(f"control_poll_s must be a number in 0.05..60, got "
                          f"{self.control_poll_s!r}")
        if self.metrics_addr is not None:
            host, sep, port = self.metrics_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise invalid(f"metrics_addr must be HOST:PORT like 127.0.0.1:9464, got "
                              f"{self.metrics_addr!r}")
        for name in ("kv_events", "kv_events_replay"):
            url = getattr(self, name)
            if url is None:
                continue
            host, sep, port = url[len("tcp://"):].rpartition(":")
            if (not url.startswith("tcp://") or not sep or not host or not port.isdigit()
                    or not 0 <= int(port) <= 65535):
                raise invalid(f"{name} must be tcp://HOST:PORT like tcp://0.0.0.0:5557, "
                              f"got {url!r}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise invalid("kv_events_replay needs kv_events")
        if self.cluster is not None:
            from ems.cluster.topology import parse_url, tls_context
            # fails closed, naming cluster (or the TLS file that cannot be read)
            tls_context(parse_url(self.cluster, self.cluster_ca_file,
                                  self.cluster_cert_file, self.cluster_key_file))
        if self.cluster_write_behind_bytes < 0:
            raise invalid(f"cluster_write_behind must be >= 0, got "
                          f"{self.cluster_write_behind_bytes}")

    @property
    def socket_path(self) -> str:
        return os.path.join(self.socket_dir, PoolSettings.SOCKET_NAME)

    @classmethod
    def load(cls, flags: Mapping[str, Any], env: Mapping[str, str]) -> "ServerConfig":
        """Merge the config file, the environment and ``flags`` (argparse values; None
        where a flag was not given)."""
        values: dict[str, Any] = {}
        path = flags.get("config") or env.get("EMS_SERVER_CONFIG")
        if path:
            values.update(_from_file(path))
        for var, key in (("EMS_SOCKET_DIR", "socket_dir"), ("EMS_SERVER_CAPACITY", "capacity"),
                         ("EMS_TENANTS_FILE", "tenants_file"), ("EMS_ANONYMOUS", "anonymous"),
                         ("EMS_RESERVATION_TTL_S", "reservation_ttl_s"),
                         ("EMS_LOG_LEVEL", "log_level"), ("EMS_SERVER_SPIN_US", "spin_us"),
                         ("EMS_CONTROL", "control"),
                         ("EMS_CONTROL_TOKEN_FILE", "control_token_file"),
                         ("EMS_HOST_NAME", "host_name"), ("EMS_METRICS_ADDR", "metrics_addr"),
                         ("EMS_KV_EVENTS", "kv_events"),
                         ("EMS_KV_EVENTS_REPLAY", "kv_events_replay"),
                         ("EMS_CLUSTER", "cluster"), ("EMS_CLUSTER_CA_FILE", "cluster_ca_file"),
                         ("EMS_CLUSTER_CERT_FILE", "cluster_cert_file"),
                         ("EMS_CLUSTER_KEY_FILE", "cluster_key_file")):
            if env.get(var):
                values[key] = _from_env(var, key, env[var])
        if env.get("EMS_CLUSTER_PASSWORD"):  # never a flag: ps would show it
            values["cluster_password"] = env["EMS_CLUSTER_PASSWORD"]
        disk = dict(values.pop("disk", {}))
        disk_sources: tuple[tuple[Optional[str], str, str], ...] = (
            ("EMS_DISK", "path", "disk"),
            ("EMS_DISK_CAPACITY", "capacity", "disk_capacity"),
            ("EMS_DISK_CHECKPOINT_S", "checkpoint_s", "disk_checkpoint_s"),
            (None, "admission", "disk_admission"))
        for env_var, key, flag in disk_sources:
            if env_var is not None and env.get(env_var):
                disk[key] = env[env_var]
            if flags.get(flag) is not None:
                disk[key] = flags[flag]
        if disk:
            values["disk"] = DiskConfig.parse(disk)
        quotas = dict(values.pop("quotas", {}))
        limits = dict(values.pop("limits", {}))
        for key in _FILE_KEYS - {"quotas", "limits", "disk"}:
            if flags.get(key) is not None:
                values[key] = flags[key]
        for item in flags.get("limit") or ():
            name, sep, value = item.partition("=")
            if not sep:
                raise invalid(f"--limit takes NAME=VALUE, got {item!r}")
            limits[name.strip()] = value.strip()
        values["limits"] = Limits.parse(limits, "limits")
        for item in flags.get("quota") or ():
            ident, sep, size = item.partition("=")
            if not sep:
                raise invalid(f"--quota takes ID=SIZE, got {item!r}")
            quotas[ident.strip()] = size.strip()
        return cls._build(values, quotas)

    @classmethod
    def _build(cls, v: dict[str, Any], quotas: dict[str, Any]) -> "ServerConfig":
        kw: dict[str, Any] = {}
        if "socket_dir" in v:
            kw["socket_dir"] = _str(v["socket_dir"], "socket_dir")
        if "capacity" in v:
            kw["capacity_bytes"] = parse_bytes(v["capacity"], "capacity")
        if "tenants_file" in v:
            kw["tenants_file"] = _str(v["tenants_file"], "tenants_file")
        if "anonymous" in v:
            if not isinstance(v["anonymous"], bool):
                raise invalid(f"anonymous must be true or false, got {v['anonymous']!r}")
            kw["anonymous"] = v["anonymous"]
        if "anonymous_quota" in v:
            kw["anonymous_quota_bytes"] = parse_bytes(v["anonymous_quota"], "anonymous_quota")
        if "reservation_ttl_s" in v:
            ttl = v["reservation_ttl_s"]
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
                raise invalid(f"reservation_ttl_s must be a number, got {ttl!r}")
            kw["reservation_ttl_s"] = float(ttl)
        if "socket_mode" in v:
            kw["socket_mode"] = _mode(v["socket_mode"])
        if "log_level" in v:
            kw["log_level"] = _str(v["log_level"], "log_level").upper()
        if "spin_us" in v:
            kw["spin_us"] = v["spin_us"]
        for key in ("control", "control_token_file", "control_cache", "host_name",
                    "metrics_addr", "kv_events", "kv_events_replay"):
            if key in v:
                kw[key] = _str(v[key], key)
        if "control_poll_s" in v:
            kw["control_poll_s"] = v["control_poll_s"]
        if "cluster" in v:
            kw["cluster"] = _str(v["cluster"], "cluster")
        for key in ("cluster_ca_file", "cluster_cert_file", "cluster_key_file"):
            if key in v:
                kw[key] = _str(v[key], key)
        if "cluster_write_behind" in v:
            kw["cluster_write_behind_bytes"] = parse_bytes(v["cluster_write_behind"],
                                                           "cluster_write_behind")
        if v.get("cluster_password"):
            kw["cluster_password"] = v["cluster_password"]
        if "limits" in v:
            kw["limits"] = v["limits"]
        if "disk" in v:
            kw["disk"] = v["disk"]
        kw["quotas_bytes"] = {k: parse_bytes(s, f"quotas.{k}") for k, s in quotas.items()}
        return cls(**kw)


def _str(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{field} must be a non-empty string, got {value!r}")
    return value


def _mode(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value), 8)
    except ValueError:
        raise invalid(f"socket_mode must be an octal permission like \"0660\", "
                      f"got {value!r}") from None


def _from_env(var: str, key: str, text: str) -> Any:
    if key == "anonymous":
        low = text.strip().lower()
        if low not in ("0", "1", "true", "false", "yes", "no"):
            raise invalid(f"{var} must be 1 or 0, got {text!r}")
        return low in ("1", "true", "yes")
    if key == "reservation_ttl_s":
        try:
            return float(text)
        except ValueError:
            raise invalid(f"{var} must be a number of seconds, got {text!r}") from None
    if key == "spin_us":
        try:
            return int(text)
        except ValueError:
            raise invalid(f"{var} must be an int of microseconds, got {text!r}") from None
    return text


def read_toml(path: str) -> dict[str, Any]:
    """Parse a TOML file (``tomllib``, or ``tomli`` before Python 3.11)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            # (no-redef only where tomli is installed; unused-ignore where it is not)
            import tomli as tomllib  # type: ignore[no-redef,unused-ignore]
        except ImportError:
            raise invalid(f"reading {path} needs Python 3.11+ or the tomli package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise invalid(f"cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise invalid(f"{path} is not valid TOML: {exc}") from exc


def _from_file(path: str) -> dict[str, Any]:
    data = read_toml(path)
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise invalid(f"{path}: unknown key(s) {', '.join(unknown)}; known: "
                      f"{', '.join(sorted(_FILE_KEYS))}")
    if "quotas" in data and not isinstance(data["quotas"], dict):
        raise invalid(f"{path}: quotas must be a table of access_id = size")
    if "limits" in data and not isinstance(data["limits"], dict):
        raise invalid(f"{path}: limits must be a table of name = value")
    if "disk" in data and not isinstance(data["disk"], dict):
        raise invalid(f"{path}: disk must be a table ([disk] with path = ...)")
    return data


def _check_id(ident: str, where: str) -> None:
    if ident == ANONYMOUS:
        raise invalid(f"{where}: {ident!r} is the anonymous namespace's display name and "
                      f"cannot be a tenant's access_id")
    try:
        validate_access_id(ident)
    except EmsException as exc:
        raise invalid(f"{where}: {ident!r} is not a valid access_id ({exc.message()})") from None


# ----------------------------------------------------------------------- tenants

@dataclasses.dataclass(frozen=True)
class TenantSpec:
    """One namespace: ``access_id`` None is the anonymous one."""

    access_id: Optional[str]
    access_key: Optional[str] = dataclasses.field(repr=False)
    quota_bytes: int

    @property
    def name(self) -> str:
        return self.access_id if self.access_id is not None else ANONYMOUS


def load_tenants(path: str) -> dict[str, str]:
    """Read a tenants file: ``access_id -> access_key``.

    The file is TOML with one table::

        [tenants]
        team-a = "k3Y...32 to 256 chars of 0-9 A-Z a-z + / =..."

    It must be a regular file that neither group nor others can read or write
    (``chmod 600``); otherwise the daemon refuses to start. Ids and keys follow the
    rules of the SDK (``validate_access_id``, ``validate_access_key``), so a client can
    present them.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise invalid(f"tenants file {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise invalid(f"tenants file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise invalid(f"tenants file {path} has mode {stat.S_IMODE(st.st_mode):04o}; it "
                      f"holds secrets and must be 0600 (chmod 600 {path})")
    data = read_toml(path)
    unknown = sorted(set(data) - {"tenants"})
    if unknown or not isinstance(data.get("tenants", {}), dict):
        raise invalid(f"tenants file {path}: expected one [tenants] table of "
                      f"access_id = \"access_key\" (unknown: {', '.join(unknown) or '-'})")
    tenants: dict[str, str] = {}
    for ident, key in data.get("tenants", {}).items():
        _check_id(ident, f"tenants file {path}")
        try:
            validate_access_key(key)
        except EmsException as exc:
            raise invalid(f"tenants file {path}: tenant {ident!r}: {exc.message()}") from None
        tenants[ident] = key
    return tenants


def resolve_quotas(config: ServerConfig, tenants: Mapping[str, str]) -> list[TenantSpec]:
    """Give every namespace its pool size (see the module docstring)."""
    unknown = sorted(set(config.quotas_bytes) - set(tenants))
    if unknown:
        raise invalid(f"quotas name access_id(s) not in the tenants file: {', '.join(unknown)}")
    explicit: dict[Optional[str], int] = {k: v for k, v in config.quotas_bytes.items()}
    members: list[Optional[str]] = [t for t in sorted(tenants)]
    if config.anonymous:
        members.append(None)
        if config.anonymous_quota_bytes is not None:
            explicit[None] = config.anonymous_quota_bytes
    if not members:
        raise invalid("no tenants file and anonymous access disabled: nobody could connect")
    fixed = sum(explicit.values())
    if fixed > config.capacity_bytes:
        raise invalid(f"quotas add up to {fixed} bytes, more than capacity "
                      f"{config.capacity_bytes}")
    shared = [m for m in members if m not in explicit]
    share = (config.capacity_bytes - fixed) // len(shared) if shared else 0
    if shared and share < (1 << 20):
        raise invalid(f"capacity leaves {share} bytes each to the {len(shared)} namespace(s) "
                      f"without a quota; raise capacity or set quotas")
    return [TenantSpec(m, None if m is None else tenants[m], explicit.get(m, share))
            for m in members]


def configure_logging(level: str) -> None:
    """The daemon's handler (the library itself never configures logging)."""
    logging.basicConfig(level=getattr(logging, level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
