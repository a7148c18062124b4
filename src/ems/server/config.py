"""Configuration of ``ems-server``: defaults < config file < environment < flags.

Every setting is declared once, as a field of :class:`ServerConfig`, :class:`Limits`
or :class:`DiskConfig` (``ems.settings``: default, doc line, file key, environment
variable, flag and parser together); the merge, the refusal of unknown keys, the
command line and the settings tables of docs/daemon.md and docs/tiers/disk.md are
made from those declarations (``python scripts/settings_tables.py`` writes the
tables; ``--check`` is part of the test command).

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
for ``spin_us`` microseconds (0: sleep at once), yielding the CPU to any other runnable
thread between polls. A request that arrives in the window is served without a
wake-up of a sleeping process (on a VM, ~10-20 us of a ~100 us 1-key round trip: the
sleeping vCPU halts, and its caches are cold after the wake-up). An idle daemon
sleeps; a busy one uses up to one CPU while it spins.

The disk tier (``--disk DIR``, ``ems.server.disk_tier``): objects of shared memory are
also kept in region files under ``DIR``, up to ``capacity``, and loaded back from there
when shared memory misses them, also after a restart or a crash (the docs' tiers page
says what survives what). Off by default.

The config file is ``--config FILE`` or ``EMS_SERVER_CONFIG``. Sizes are bytes or
``512M``/``4G`` (binary units). Unknown keys and bad values stop the daemon with a
message naming them (fail closed).

Capacity and quotas: ``capacity`` bounds the memory of the whole daemon. Each tenant
(and the anonymous namespace, when enabled) gets its own pool: its quota when one is
configured, else an equal share of what the explicit quotas leave
(``ems.server.tenants.resolve_quotas``). Quotas that add up to more than ``capacity``
are refused. The tenants file (secrets, mode 0600) is read by
``ems.server.tenants.load_tenants``.

(The style guide keeps ``EMS_*`` reads in ``ems.config``; the daemon's own variables
are declared here and read from the mapping ``main`` passes in, because nothing in the
SDK uses them and the daemon must not depend on the SDK's client settings.)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, Mapping, Optional

from ems.config import PoolSettings, validate_access_id
from ems.errors import EmsException, invalid
from ems.settings import (
    Boolean,
    Choice,
    Integer,
    Layer,
    Number,
    Setting,
    Size,
    Text,
    add_flags,
    check_fields,
    load,
    section,
    setting,
    table,
)

__all__ = ["ANONYMOUS", "CONFIG_FILE", "SDK_MAX_KEY_BYTES", "DiskConfig", "Limits",
           "ServerConfig", "add_server_flags", "check_id", "configure_logging",
           "read_toml"]

ANONYMOUS = "(anonymous)"  # display name; refused as an access_id (check_id)
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: ``huge_pages`` settings (``ems.server.tenants``' module doc)
HUGE_PAGES = ("off", "auto", "on")
#: The longest storage key the SDK makes: a PrimaryKey of two 127-character parts of
#: 4-byte UTF-8 characters, and its ``v0:p:127:`` prefix (V1 keys are ~50 bytes).
SDK_MAX_KEY_BYTES = 2 * 127 * 4 + 16
#: where the config file itself is named (not a setting of the file)
CONFIG_FILE = Setting("TOML config file", Text(), None, ("EMS_SERVER_CONFIG",), "--config",
                      metavar="FILE")


def check_id(ident: str, where: str) -> None:
    """A tenant's access_id as a key of ``quotas`` or the tenants file."""
    if ident == ANONYMOUS:
        raise invalid(f"{where}: {ident!r} is the anonymous namespace's display name and "
                      f"cannot be a tenant's access_id")
    try:
        validate_access_id(ident)
    except EmsException as exc:
        raise invalid(f"{where}: {ident!r} is not a valid access_id ({exc.message()})") from None


def _disk_tenant(ident: str, where: str) -> None:
    if ident != ANONYMOUS:
        check_id(ident, where)


def _mode(raw: Any, where: str) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    else:
        try:
            value = int(str(raw), 8)
        except ValueError:
            raise invalid(f"{where} must be an octal permission like \"0660\", "
                          f"got {raw!r}") from None
    if not 0 <= value <= 0o777:
        raise invalid(f"{where} must be an octal permission like 0660, got {value:o}")
    return value


def _http_url(raw: Any, where: str) -> str:
    url = Text()(raw, where)
    if not url.startswith(("http://", "https://")):
        raise invalid(f"{where} must be an http:// or https:// URL, got {url!r}")
    return url


def _host_port(raw: Any, where: str) -> str:
    addr = Text()(raw, where)
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise invalid(f"{where} must be HOST:PORT like 127.0.0.1:9464, got {addr!r}")
    return addr


def _tcp_url(raw: Any, where: str) -> str:
    url = Text()(raw, where)
    host, sep, port = url[len("tcp://"):].rpartition(":")
    if (not url.startswith("tcp://") or not sep or not host or not port.isdigit()
            or not 0 <= int(port) <= 65535):
        raise invalid(f"{where} must be tcp://HOST:PORT like tcp://0.0.0.0:5557, "
                      f"got {url!r}")
    return url


def _positive(doc: str, default: int, *, size: bool = False, low: int = 1) -> Any:
    return setting(doc, Size() if size else Integer(low), default=default)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds that keep one local process (any user who can reach the socket) from
    hurting the others. Each has a default, a ``[limits]`` key in the config file and
    ``--limit NAME=VALUE``, a refusal the client understands, and a counter in
    ``ems stats`` (``server.refused``); docs/daemon.md's *Limits* says what a client
    sees over each.

    A request is handled inline by the event loop: at ~2-3 us per key, 4096 keys keep
    other connections waiting ~10 ms at most (300k keys in one frame stalled them for
    0.5-1.3 s before these limits existed).
    """

    max_keys_per_request: int = _positive(
        "keys of one request; over it the request is refused (EMS_INVALID_ARGUMENT, "
        "naming the limit); the SDK never sees it: it reads the limit from the daemon's "
        "welcome and sends larger calls in slices (in order, a load stopping at its first "
        "miss)", 4096)
    max_key_bytes: int = _positive(
        "bytes of one storage key; over it refused (EMS_INVALID_ARGUMENT); 1032 bytes is "
        "the longest key the SDK's own rule (each key part < 128 characters) can make",
        SDK_MAX_KEY_BYTES, size=True)
    max_pins_per_connection: int = _positive(
        "objects one connection holds pinned; an Acquire pins what fits, the keys after "
        "it miss (CcResult.success is shorter)", 65536)
    max_frame_bytes: int = _positive(
        "bytes of one frame; over it the connection is closed (EMS_PROTOCOL_ERROR); a "
        "request of 4096 keys of 1032 bytes fits", 8 << 20, size=True)
    max_buffered_bytes: int = _positive(
        "bytes of partial frames of all connections together: the connection that goes "
        "over is closed (EMS_IO_ERROR)", 64 << 20, size=True)
    max_connections_per_uid: int = _positive(
        "connections of one local user; over it refused at accept (EMS_RECOVERD_ERROR: "
        "Ems.init may be retried later)", 256)
    max_connections_per_tenant: int = _positive(
        "connections of one tenant; over it refused at hello (EMS_RECOVERD_ERROR); the "
        "anonymous namespace is one tenant", 1024)
    max_leases_per_connection: int = _positive(
        "leases of one connection; over it no lease: that connection's small saves take "
        "reserve + commit (two round trips)", 4)
    lease_share: float = setting(
        "share of a tenant's pool all its leases together may hold; over it no lease, as "
        "above", Number(0, 1, open_low=True), default=0.25)
    handshake_timeout_s: float = setting(
        "seconds; a connection that has not finished its handshake by then is closed",
        Number(0, open_low=True), default=10.0)

    def __post_init__(self) -> None:
        check_fields(self, "limits.")
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


@dataclasses.dataclass(frozen=True)
class DiskConfig:
    """The disk tier (``[disk]`` in the config file; ``--disk DIR`` turns it on)."""

    path: str = setting("directory of the region files (made 0700); set: the tier is on",
                        Text(), env="EMS_DISK", flag="--disk", metavar="DIR")
    capacity_bytes: int = setting(
        "bytes of records at most, all tenants (more than the filesystem: warned)", Size(),
        default=64 << 30, key="capacity", env="EMS_DISK_CAPACITY", flag="--disk-capacity",
        metavar="SIZE")
    checkpoint_s: float = setting(
        "the index is checkpointed this often, seconds", Number(0.05, 86400),
        default=10.0, env="EMS_DISK_CHECKPOINT_S", flag="--disk-checkpoint-s",
        metavar="S")
    admission: str = setting(
        "which new objects are written: all, or second-hit: only a key stored again "
        "(its first store is remembered among the last 2^18 keys, not written; loads "
        "do not count)", Choice(("all", "second-hit")), default="all",
        flag="--disk-admission")
    write_budget_bytes_per_day: Optional[int] = setting(
        "bytes written per day at most (SSD wear); past it nothing is admitted until "
        "the next day (counted)", Size(), default=None, key="write_budget", shown="none")
    flush_on_stop_s: float = setting(
        "on SIGTERM, write what shared memory holds and the disk does not, for at most "
        "this long, seconds", Number(0, 86400), default=30.0)
    io_threads: int = setting(
        "the disk's queue depth: read worker threads, and as many write worker threads "
        "(reads never wait behind writes)", Integer(1, 64), default=8)
    inflight_bytes: int = setting("bytes of writes in flight at most", Size(),
                                  default=64 << 20, key="inflight")
    queue_bytes: int = setting(
        "bytes of writes waiting at most (past it a save is not written: counted)", Size(),
        default=1 << 30, key="queue")
    save_wait_ms: float = setting(
        "a save that finds shared memory full of objects not on disk yet waits this "
        "long at most (and half of what is left of its deadline at most) for the disk's "
        "writer before it evicts one (counted), ms; 0: it evicts at once",
        Number(0, 60000), default=1000.0)
    write_buffer_bytes: int = setting(
        "bytes of values packed into one write (one pwritev, one batch head; a multiple "
        "of 4096, below 4G)", Size(), default=8 << 20, key="write_buffer")
    quotas_bytes: Mapping[str, int] = table(
        "a tenant's disk bytes", Size(), key="quotas", check_key=_disk_tenant,
        shown="its share of the pool's capacity, of the disk's")
    announce_recovered: bool = setting(
        "with --kv-events: after a restart, publish BlockStored(ems-disk) for the "
        "recovered records whose engine hash was known at the last checkpoint interval "
        "or clean stop (kept in DIR/kv-hashes)", Boolean(), default=True)
    io_delay_ms: float = setting(
        "fault testing only: every read and write of the disk waits this long first, ms",
        Number(0, 86400), default=0.0)

    def __post_init__(self) -> None:
        check_fields(self, "disk.")
        if self.write_buffer_bytes % 4096 or self.write_buffer_bytes >= 1 << 32:
            raise invalid(f"disk.write_buffer must be a multiple of 4096 below 4G, got "
                          f"{self.write_buffer_bytes}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The daemon's settings (see the module docstring)."""

    socket_dir: str = setting(
        "directory of ems.sock (shared with the inference processes)", Text(),
        default=PoolSettings.socket_dir, env="EMS_SOCKET_DIR", flag="--socket-dir",
        metavar="DIR")
    capacity_bytes: int = setting(
        "memory of all pools together", Size(), key="capacity",
        default_factory=lambda: PoolSettings().capacity_bytes, shown="min(4G, RAM/4)",
        env="EMS_SERVER_CAPACITY", flag="--capacity", metavar="SIZE")
    tenants_file: Optional[str] = setting(
        "TOML file of access_id = \"access_key\" (mode 0600); unset: no tenants", Text(),
        default=None, env="EMS_TENANTS_FILE", flag="--tenants-file", metavar="FILE")
    anonymous: bool = setting("allow clients without credentials (their own namespace)",
                              Boolean(), default=True, env="EMS_ANONYMOUS",
                              flag="--anonymous")
    anonymous_quota_bytes: Optional[int] = setting(
        "pool size of the anonymous namespace", Size(), default=None,
        key="anonymous_quota", shown="an equal share", flag="--anonymous-quota",
        metavar="SIZE")
    quotas_bytes: Mapping[str, int] = table(
        "pool size of tenant ID", Size(), key="quotas", check_key=check_id,
        pairs_flag="--quota", metavar="ID=SIZE", shown="an equal share")
    reservation_ttl_s: float = setting(
        "a writer's reservation is freed this long after it was made, seconds",
        Number(0, 86400, open_low=True), default=60.0, env="EMS_RESERVATION_TTL_S",
        flag="--reservation-ttl-s")
    socket_mode: int = setting("permissions of the socket file (the directory's still apply)",
                               _mode, default=0o660, shown="0660", flag="--socket-mode")
    log_level: str = setting("DEBUG, INFO, WARNING or ERROR", Choice(_LEVELS, fold="upper"),
                             default="INFO", env="EMS_LOG_LEVEL", flag="--log-level")
    huge_pages: str = setting(
        "back each tenant's shared memory with the system's reserved huge pages "
        "(vm.nr_hugepages; a segment rounds up to whole pages): a disk tier's reads and "
        "writes reach the device in fewer, larger requests; auto: where enough are free, "
        "else 4 KiB pages (logged); on: a tenant without them is an error",
        Choice(HUGE_PAGES), default="off", env="EMS_HUGE_PAGES",
        flag="--huge-pages")
    spin_us: int = setting(
        "busy-poll this long after a request before sleeping, microseconds (0: never)",
        Integer(0, 1_000_000), default=200, env="EMS_SERVER_SPIN_US", flag="--spin-us")
    control: Optional[str] = setting(
        "URL of ems-control: tenants, keys and quotas come from there, live", _http_url,
        default=None, env="EMS_CONTROL", flag="--control", metavar="URL")
    control_token_file: Optional[str] = setting(
        "file (0600) of the daemon token of ems-control", Text(), default=None,
        env="EMS_CONTROL_TOKEN_FILE", flag="--control-token-file", metavar="FILE")
    control_poll_s: float = setting("fetch the registry (and report) this often, seconds",
                                    Number(0.05, 60), default=1.0, flag="--control-poll-s")
    control_cache: Optional[str] = setting(
        "file (0600) keeping the last registry for a restart while the control plane is "
        "down; unset: memory only", Text(), default=None, flag="--control-cache",
        metavar="FILE")
    host_name: Optional[str] = setting(
        "this daemon's name on the control plane and in KV events", Text(), default=None,
        shown="hostname:socket_dir", env="EMS_HOST_NAME", flag="--host-name")
    metrics_addr: Optional[str] = setting(
        "serve Prometheus metrics on HOST:PORT, e.g. 127.0.0.1:9464", _host_port,
        default=None, env="EMS_METRICS_ADDR", flag="--metrics-addr", metavar="HOST:PORT")
    kv_events: Optional[str] = setting(
        "publish KV events (vLLM's format) on a ZMQ PUB socket bound at tcp://HOST:PORT "
        "(port 0: any; needs pyzmq)", _tcp_url, default=None, env="EMS_KV_EVENTS",
        flag="--kv-events", metavar="URL")
    kv_events_replay: Optional[str] = setting(
        "their replay ROUTER endpoint, tcp://HOST:PORT", _tcp_url, default=None,
        env="EMS_KV_EVENTS_REPLAY", flag="--kv-events-replay", metavar="URL")
    cluster: Optional[str] = setting(
        "join the shared tier: valkey://HOST:PORT[,HOST:PORT...] (valkeys://: TLS)",
        Text(), default=None, env="EMS_CLUSTER", flag="--cluster", metavar="URL",
        repr=False)
    cluster_ca_file: Optional[str] = setting(
        "CA bundle for a valkeys:// cluster", Text(), default=None,
        env="EMS_CLUSTER_CA_FILE", flag="--cluster-ca-file", metavar="FILE")
    cluster_cert_file: Optional[str] = setting(
        "this daemon's TLS certificate (PEM) for a cluster that verifies its clients",
        Text(), default=None, env="EMS_CLUSTER_CERT_FILE", flag="--cluster-cert-file",
        metavar="FILE")
    cluster_key_file: Optional[str] = setting(
        "its private key, unless in the certificate file", Text(), default=None,
        env="EMS_CLUSTER_KEY_FILE", flag="--cluster-key-file", metavar="FILE")
    cluster_password: Optional[str] = setting(
        "the cluster's password (never a flag or a file key: ps and backups show those)",
        Text(), default=None, key=None, env="EMS_CLUSTER_PASSWORD", repr=False)
    cluster_write_behind_bytes: int = setting(
        "bytes of write-behind in flight at most (past it a save stays local only)",
        Size(), default=256 << 20, key="cluster_write_behind",
        flag="--cluster-write-behind", metavar="SIZE")
    limits: Limits = section("bounds on what one client may hold or send (the limits' table)",
                             Limits, key="limits", pairs_flag="--limit")
    disk: Optional[DiskConfig] = section(
        "the disk tier (off unless its path is given; its settings: the disk tier's page)",
        DiskConfig, key="disk", optional=True)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.control is not None:
            if self.control_token_file is None:
                raise invalid("control needs control_token_file (the daemon token of "
                              "ems-control)")
            if self.tenants_file is not None:
                raise invalid("control and tenants_file exclude each other: with a "
                              "control plane, tenants come from it")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise invalid("kv_events_replay needs kv_events")
        if self.cluster is not None:
            from ems.cluster.topology import parse_url, tls_context
            # fails closed, naming cluster (or the TLS file that cannot be read)
            tls_context(parse_url(self.cluster, self.cluster_ca_file,
                                  self.cluster_cert_file, self.cluster_key_file))

    @property
    def socket_path(self) -> str:
        return os.path.join(self.socket_dir, PoolSettings.SOCKET_NAME)

    @classmethod
    def load(cls, flags: Mapping[str, Any], env: Mapping[str, str]) -> "ServerConfig":
        """Merge the config file, the environment and ``flags`` (argparse values; None
        where a flag was not given)."""
        path = flags.get("config") or (env.get("EMS_SERVER_CONFIG") or "").strip()
        layers = [Layer.table(read_toml(path), path)] if path else []
        return load(cls, [*layers, Layer.environ(env), Layer.flags(flags)])


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per declared setting of :class:`ServerConfig`."""
    parser.add_argument(CONFIG_FILE.flag or "", metavar=CONFIG_FILE.metavar,
                        help=f"{CONFIG_FILE.doc} (env {CONFIG_FILE.env[0]})")
    add_flags(parser, ServerConfig)


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


def configure_logging(level: str) -> None:
    """The daemon's handler (the library itself never configures logging)."""
    logging.basicConfig(level=getattr(logging, level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
