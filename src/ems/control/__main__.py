"""``ems-control`` / ``python -m ems.control``: run the control plane.

Exit status: 0 after a clean stop (SIGTERM/SIGINT), 1 when it cannot listen,
2 for a bad configuration (a message names the setting).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Optional, Sequence

__all__ = ["main"]

logger = logging.getLogger("ems.control")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ems-control",
        description="The ems control plane: tenants, access keys and quotas of every "
                    "ems-server over REST (OpenAPI at /docs), and a status page at /.",
        epilog="Settings: defaults < environment < flags (docs/control-plane.md).")
    from ems.control.config import ControlConfig  # the declarations make the flags
    ControlConfig.add_flags(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from ems.errors import EmsException

    try:
        from ems.control.config import ControlConfig
        config = ControlConfig.load(vars(args), os.environ)
        import uvicorn

        from ems.control.app import Service, create_app
        logging.basicConfig(level=getattr(logging, config.log_level),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        service = Service(config)
    except ImportError as exc:
        print(f"ems-control: {exc.name} is missing; install the control extra "
              f"(pip install 'ems-kvpool[control]')", file=sys.stderr)
        return 2
    except EmsException as exc:
        print(f"ems-control: bad configuration: {exc.message()}", file=sys.stderr)
        return 2
    try:
        sock = socket.create_server((config.host, config.port), reuse_port=False)
    except OSError as exc:
        logger.error("ems-control: cannot listen on %s:%d: %s", config.host, config.port,
                     exc.strerror)
        return 1
    port = sock.getsockname()[1]
    if config.port_file:
        tmp = config.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, config.port_file)
    logger.info("ems-control listening on http://%s:%d (database %s, pid %d)",
                config.host, port, config.file("control.db"), os.getpid())
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning",
                                           access_log=False, lifespan="off"))
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then restores the handlers it
    # found and raises the signal again. With the default handlers that kills the
    # process (exit -15) or raises KeyboardInterrupt before the cleanup below runs. The
    # handlers it finds are these: they note the signal (and stop a server that has not
    # installed its own yet), and a stop signal is the documented way to stop, so the
    # cleanup runs and the exit status is 0.
    stopped_by: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        service.db.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("ems-control stopped%s",
                f" ({signal.Signals(stopped_by[0]).name})" if stopped_by else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
