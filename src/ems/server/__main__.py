"""``ems-server`` / ``python -m ems.server``: run the daemon, or ``stats``.

Exit status: 0 after a clean stop (SIGTERM/SIGINT), 1 when the daemon cannot start
(another daemon on the socket, unusable socket directory), 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from ems.server.config import ServerConfig

__all__ = ["main"]

logger = logging.getLogger("ems.server")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ems-server",
        description="The ems per-host KV-cache pool daemon. Subcommand: `ems-server stats "
                    "[--json]` prints the counters of a running daemon.",
        epilog="Settings: defaults < config file < environment < flags; see "
               "`python -c 'import ems.server.config as c; help(c)'`.")
    p.add_argument("--config", help="TOML config file (env EMS_SERVER_CONFIG)")
    p.add_argument("--socket-dir", dest="socket_dir",
                   help="directory of ems.sock (default /dev/shm/ems; env EMS_SOCKET_DIR)")
    p.add_argument("--capacity", help="memory of all pools, e.g. 8G (default min(4G, RAM/4); "
                                      "env EMS_SERVER_CAPACITY)")
    p.add_argument("--tenants-file", dest="tenants_file",
                   help="TOML file of access_id = \"access_key\" (mode 0600; "
                        "env EMS_TENANTS_FILE)")
    anon = p.add_mutually_exclusive_group()
    anon.add_argument("--anonymous", dest="anonymous", action="store_const", const=True,
                      help="allow clients without credentials (default; env EMS_ANONYMOUS)")
    anon.add_argument("--no-anonymous", dest="anonymous", action="store_const", const=False,
                      help="refuse clients without credentials")
    p.add_argument("--anonymous-quota", dest="anonymous_quota",
                   help="pool size of the anonymous namespace (default: an equal share)")
    p.add_argument("--quota", action="append", metavar="ID=SIZE",
                   help="pool size of tenant ID (repeatable; default: an equal share)")
    p.add_argument("--reservation-ttl-s", dest="reservation_ttl_s", type=float,
                   help="free a writer's reservation after this long (default 60; "
                        "env EMS_RESERVATION_TTL_S)")
    p.add_argument("--socket-mode", dest="socket_mode",
                   help="octal permissions of the socket file (default 0660)")
    p.add_argument("--spin-us", dest="spin_us", type=int,
                   help="busy-poll this long after a request before sleeping, in "
                        "microseconds (default 200; 0: never; env EMS_SERVER_SPIN_US)")
    p.add_argument("--control", help="URL of ems-control: tenants, keys and quotas come "
                                     "from there, live (env EMS_CONTROL)")
    p.add_argument("--control-token-file", dest="control_token_file",
                   help="file of the daemon token of ems-control (env EMS_CONTROL_TOKEN_FILE)")
    p.add_argument("--control-poll-s", dest="control_poll_s", type=float,
                   help="fetch the registry this often (default 1.0 s)")
    p.add_argument("--control-cache", dest="control_cache",
                   help="keep the last registry in this file (0600) for a restart while the "
                        "control plane is down (default: memory only)")
    p.add_argument("--host-name", dest="host_name",
                   help="this daemon's name on the control plane (default hostname:socket_dir)")
    p.add_argument("--metrics-addr", dest="metrics_addr",
                   help="serve Prometheus metrics on HOST:PORT, e.g. 127.0.0.1:9464 "
                        "(default off; env EMS_METRICS_ADDR)")
    p.add_argument("--kv-events", dest="kv_events",
                   help="publish KV events (vLLM's format) on a ZMQ PUB socket bound at "
                        "tcp://HOST:PORT (default off; env EMS_KV_EVENTS; needs pyzmq)")
    p.add_argument("--kv-events-replay", dest="kv_events_replay",
                   help="their replay endpoint, tcp://HOST:PORT (env EMS_KV_EVENTS_REPLAY)")
    p.add_argument("--cluster", dest="cluster",
                   help="join the shared tier: valkey://HOST:PORT[,HOST:PORT...] "
                        "(valkeys://: TLS; env EMS_CLUSTER; password: EMS_CLUSTER_PASSWORD)")
    p.add_argument("--cluster-ca-file", dest="cluster_ca_file",
                   help="CA bundle for a valkeys:// cluster (env EMS_CLUSTER_CA_FILE)")
    p.add_argument("--cluster-cert-file", dest="cluster_cert_file",
                   help="this daemon's TLS certificate (PEM) for a cluster that verifies "
                        "its clients (env EMS_CLUSTER_CERT_FILE)")
    p.add_argument("--cluster-key-file", dest="cluster_key_file",
                   help="its private key, unless in the certificate file "
                        "(env EMS_CLUSTER_KEY_FILE)")
    p.add_argument("--cluster-write-behind", dest="cluster_write_behind",
                   help="bytes of write-behind in flight at most, e.g. 256M (default)")
    p.add_argument("--disk", dest="disk", metavar="DIR",
                   help="keep objects also on disk under DIR (the disk tier: the pool "
                        "outgrows memory and survives restarts; env EMS_DISK)")
    p.add_argument("--disk-capacity", dest="disk_capacity", metavar="SIZE",
                   help="bytes the disk tier may use, e.g. 500G (default 64G; env "
                        "EMS_DISK_CAPACITY)")
    p.add_argument("--disk-checkpoint-s", dest="disk_checkpoint_s", metavar="S",
                   help="checkpoint the disk index this often (default 10; env "
                        "EMS_DISK_CHECKPOINT_S)")
    p.add_argument("--disk-admission", dest="disk_admission", choices=("all", "second-hit"),
                   help="which objects go to disk: every one saved (all, default) or "
                        "those saved again or loaded (second-hit)")
    p.add_argument("--limit", action="append", metavar="NAME=VALUE",
                   help="a bound on what one client may hold or send (repeatable), e.g. "
                        "max_keys_per_request=4096; see ems.server.config.Limits")
    p.add_argument("--log-level", dest="log_level",
                   help="DEBUG, INFO, WARNING or ERROR (default INFO; env EMS_LOG_LEVEL)")
    return p


class _KvEvents:
    """The KV events publisher (``ems.server.kv_events``) as one of ``main``'s extras:
    bound before the daemon starts (it sends AllBlocksCleared at once); the daemon
    reports stores and evictions to ``publisher`` through its tier seam."""

    def __init__(self, config: "ServerConfig") -> None:
        import socket

        import zmq

        from ems.server.kv_events import KvEventPublisher
        host = config.host_name or socket.gethostname()
        assert config.kv_events is not None
        try:
            self.publisher = KvEventPublisher(config.kv_events, host,
                                              replay_endpoint=config.kv_events_replay)
        except zmq.ZMQError as exc:  # an address in use, or not this host's
            raise OSError(f"cannot bind {config.kv_events}: {exc}") from exc

    def stop(self) -> None:
        self.publisher.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stats"]:
        from ems.stats import main as stats_main  # a client tool, outside the daemon
        return stats_main(argv[1:])
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    args = _parser().parse_args(argv)

    from ems.errors import EmsException
    from ems.server.config import (
        ANONYMOUS,
        ServerConfig,
        configure_logging,
        load_tenants,
        resolve_quotas,
    )
    from ems.server.daemon import Daemon, DaemonError
    from ems.server.tenants import TenantRegistry

    try:
        config = ServerConfig.load(vars(args), os.environ)
        tenants = load_tenants(config.tenants_file) if config.tenants_file else {}
        if config.control:
            from ems.server.control_sync import ControlSync, static_specs
            specs = static_specs(config)
        else:
            specs = resolve_quotas(config, tenants)
    except EmsException as exc:
        print(f"ems-server: bad configuration: {exc.message()}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    registry = TenantRegistry(specs, config.reservation_ttl_s)
    daemon = Daemon(config, registry)
    # SIGTERM / SIGINT stop the daemon cleanly from here on: the socket accepts (and a
    # supervisor may stop it) before serve_forever installs its own handlers, and the
    # default action in that window was death by the signal (exit -15), socket left.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.request_stop())
    extras: list = []  # the threads beside the loop (control sync, metrics), stopped after it
    try:  # before the socket: a bad token file or a busy metrics port stops the start
        sync = None
        if config.control:
            sync = ControlSync(config, daemon)
        if config.metrics_addr:
            from ems.server.metrics import MetricsExporter
            extras.append(MetricsExporter(config.metrics_addr, daemon).start())
        if config.kv_events:
            events = _KvEvents(config)
            extras.append(events)
            daemon.kv_events = events.publisher  # watched by ems.server.events_observer
    except (EmsException, ImportError, OSError) as exc:
        for extra in extras:
            extra.stop()
        registry.close()
        why = (exc.message() if isinstance(exc, EmsException) else
               f"--kv-events: {exc}" if isinstance(exc, OSError) else
               f"--kv-events needs {exc.name} (pip install 'ems-kvpool[events]')"
               if exc.name == "zmq" else
               f"--control and --metrics-addr need {exc.name} "
               f"(pip install 'ems-kvpool[control]')")
        print(f"ems-server: bad configuration: {why}", file=sys.stderr)
        return 2
    try:
        daemon.start()
    except DaemonError as exc:
        for extra in extras:
            extra.stop()
        registry.close()
        logger.error("%s", exc)
        return 1
    if sync is not None:  # after the wake socket exists: it hands plans to the loop
        extras.append(sync.start())
    names = [s.name for s in specs]
    mode = (f"from {config.control}{' + anonymous' if names else ''}" if config.control else
            "anonymous only" if names == [ANONYMOUS] else
            f"{len(tenants)} tenant(s){' + anonymous' if config.anonymous else ''}")
    logger.info("ems-server listening on %s: capacity %d MiB, tenants: %s, quotas: %s, "
                "reservation TTL %.1f s, busy-poll %d us, pid %d", config.socket_path,
                config.capacity_bytes >> 20, mode,
                ", ".join(f"{s.name}={s.quota_bytes >> 20} MiB" for s in specs),
                config.reservation_ttl_s, config.spin_us, os.getpid())
    try:
        daemon.serve_forever()
    finally:
        for extra in extras:
            extra.stop()
    logger.info("ems-server stopped; removed %s", config.socket_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
