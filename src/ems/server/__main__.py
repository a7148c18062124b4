"""``ems-server`` / ``python -m ems.server``: run the daemon, or ``stats``.

Exit status: 0 after a clean stop (SIGTERM/SIGINT), 1 when the daemon cannot start
(another daemon on the socket, unusable socket directory), 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import gc
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
        epilog="Settings: defaults < config file < environment < flags; each flag's "
               "file key and the [limits] and [disk] tables: docs/daemon.md (made from "
               "the declarations in ems.server.config).")
    from ems.server.config import add_server_flags  # the declarations make the flags
    add_server_flags(p)
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
    from ems.server.config import ANONYMOUS, ServerConfig, configure_logging
    from ems.server.daemon import Daemon, DaemonError
    from ems.server.tenants import TenantRegistry, load_tenants, resolve_quotas

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
    try:
        registry = TenantRegistry(specs, config.reservation_ttl_s,
                                  huge_pages=config.huge_pages)
    except OSError as exc:  # the memory is not there (huge pages on and none to spare)
        print(f"ems-server: cannot make the shared memory: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
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
    _tune_gc()
    try:
        daemon.serve_forever()
    finally:
        for extra in extras:
            extra.stop()
    logger.info("ems-server stopped; removed %s", config.socket_path)
    return 0


#: The cyclic garbage collector's thresholds in the daemon (Python's: 700, 10, 10).
#: Its loop's requests hold lists of thousands of keys, grants and tokens, and each
#: young-generation collection walks every young list's items. Spilling 512 MiB of 16
#: KiB values through ``ems-server --disk`` (2-vCPU VM, three alternating pairs), the
#: defaults ran 380-385 collections for 0.078-0.096 s (2.4-2.9 us a value, the
#: interpreter lock held; 3 of them full ones of ~10 ms each); these thresholds and
#: :func:`_tune_gc`'s freeze ran 39-42 for 0.022-0.031 s (a young one ~0.5-0.7 ms, none
#: full).
GC_THRESHOLDS = (10_000, 10, 10)


def _tune_gc() -> None:
    """Before serving: what start-up made so far (modules, settings, the tiers' state)
    leaves the collector's view for good (``gc.freeze``: none of it is cyclic garbage
    before the daemon stops; what refcounts free is freed as ever), and the thresholds
    become :data:`GC_THRESHOLDS`."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


if __name__ == "__main__":
    sys.exit(main())
