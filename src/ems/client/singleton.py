"""``Ems``: the process-wide entry point (``init`` once, ``get_cc``, ``check_health``).

Pool selection (``EMS_POOL``, read by :class:`ems.config.PoolSettings`):

* ``embedded``: an in-process pool (nothing to start; not shared between processes);
* ``server``: the ``ems-server`` daemon on ``$EMS_SOCKET_DIR/ems.sock``; ``Ems.init``
  fails within ``EMS_CONNECT_TIMEOUT_MS`` when it does not answer;
* ``auto`` (default): the daemon when its socket exists, else the embedded pool.
  One INFO line says which was chosen.

``Ems.init`` is once per process: a second call with an equal config returns at once,
one with a different config raises ``EMS_ALREADY_INITIALIZED`` (call
``Ems.finalize()`` first). A failed ``init`` leaves nothing behind and may be retried
(real clients re-init from their health check after ``EMS_RECOVERD_ERROR``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from ems.client.context_caching import ContextCaching
from ems.client.transport import Transport
from ems.config import EmsConfig, PoolSettings, validate_ems_config
from ems.errors import EmsErrorCode, EmsException

__all__ = ["Ems", "SOCKET_NAME", "open_transport"]

logger = logging.getLogger(__name__)

SOCKET_NAME = PoolSettings.SOCKET_NAME


def open_transport(settings: PoolSettings, config: EmsConfig) -> Transport:
    """Connect to the pool that ``settings`` selects."""
    sock = settings.socket_path
    mode = settings.resolved_mode()
    if mode == "embedded":
        from ems.client.embedded import EmbeddedTransport
        tenant = f"{config.access_id}/" if config.access_id else ""
        transport: Transport = EmbeddedTransport(settings.capacity_bytes, namespace=tenant)
        logger.info("ems: using the embedded pool (%d MiB, in this process)",
                    settings.capacity_bytes >> 20)
        return transport
    try:
        from ems.client.remote import RemoteTransport
    except ImportError:
        raise EmsException(EmsErrorCode.EMS_UNAVAILABLE,
                           "EMS_POOL=server: this build has no daemon client") from None
    transport = RemoteTransport.connect(sock, config.access_id, config.access_key,
                                        settings.connect_timeout_ms / 1000.0,
                                        spin_s=settings.spin_us / 1e6)
    logger.info("ems: using the ems-server daemon at %s", sock)
    return transport


class Ems:
    """Process-wide SDK state. All methods are class methods."""

    _lock = threading.RLock()
    _config: Optional[EmsConfig] = None
    _transport: Optional[Transport] = None
    _cc: Optional[ContextCaching] = None

    @classmethod
    def init(cls, config: EmsConfig) -> None:
        """Validate ``config``, reach the pool, authenticate. Raises ``EmsException``."""
        validate_ems_config(config)
        settings = PoolSettings.from_env()
        with cls._lock:
            if cls._transport is not None:
                if config == cls._config:
                    return
                raise EmsException(EmsErrorCode.EMS_ALREADY_INITIALIZED,
                                   "Ems.init was already called with a different config; "
                                   "call Ems.finalize() first")
            transport = open_transport(settings, config)
            cc = None
            if config.cc_config is not None or config.cc_config_v1 is not None:
                cc = ContextCaching(transport, config.cc_config, config.cc_config_v1,
                                    workers=settings.workers,
                                    tenant=config.access_id or "")
            cls._config, cls._transport, cls._cc = config, transport, cc

    @classmethod
    def get_cc(cls) -> Optional[ContextCaching]:
        """The ContextCaching object; None before a successful init with a cc config."""
        return cls._cc

    @classmethod
    def check_health(cls) -> bool:
        """True when the pool answers. Never raises."""
        try:
            transport = cls._transport
            return transport is not None and bool(transport.health())
        except Exception:  # noqa: BLE001 - a probe never raises
            return False

    @classmethod
    def finalize(cls) -> None:
        """Wait for requests in flight, disconnect, drop the embedded pool. Idempotent;
        ``init`` may be called again afterwards."""
        with cls._lock:
            cc, transport = cls._cc, cls._transport
            cls._config = cls._transport = cls._cc = None
        if cc is not None:
            cc.close()
        if transport is not None:
            transport.close()

    @classmethod
    def _state(cls) -> dict[str, Any]:
        return {"initialized": cls._transport is not None,
                "pool": getattr(cls._transport, "kind", None)}
