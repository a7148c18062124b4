"""``Ems``: the process-wide entry point (``init`` once, ``get_cc``, ``check_health``).

Pool selection (``EMS_POOL``, read by :class:`ems.config.PoolSettings`):

* ``embedded``: an in-process pool (nothing to start; not shared between processes);
* ``server``: the ``ems-server`` daemon on ``$EMS_SOCKET_DIR/ems.sock``; ``Ems.init``
  fails within ``EMS_CONNECT_TIMEOUT_MS`` when it does not answer, with
  ``EMS_RECOVERD_ERROR`` (retry later) unless retrying cannot help (auth refused);
* ``auto`` (default): the daemon when its socket exists, else the embedded pool.
  One INFO line says which was chosen.

``Ems.init`` is once per process: a second call with an equal config returns at once,
one with a different config raises ``EMS_ALREADY_INITIALIZED`` (call
``Ems.finalize()`` first). A failed ``init`` leaves nothing behind and may be retried.

How the real EMS adapter recovers, and what each answer of ``init`` makes it do::

    Ems.init --ok--------------------------------------------> serving with the pool
       |--EMS_RECOVERD_ERROR (pool not reachable *yet*)--> degraded; a thread polls
       |        Ems.check_health() every ~10 s --True--> Ems.init again (+ register_kvcache)
       +--any other code (bad config, auth refused) --------> degraded for good

So ``init`` raises ``EMS_RECOVERD_ERROR`` when the daemon cannot be reached yet (no
socket, connection refused, no answer within the connect timeout, the connection
dropped during the handshake), and ``check_health()`` before a successful init probes
the pool ``init`` would use (the daemon's socket, bounded by
:data:`PROBE_TIMEOUT_S`; the embedded pool is always healthy) and never raises.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from ems.client import cuda
from ems.client.context_caching import ContextCaching
from ems.client.transport import Transport
from ems.config import EmsConfig, PoolSettings, has_credentials, validate_ems_config
from ems.errors import EmsErrorCode, EmsException

__all__ = ["Ems", "PROBE_TIMEOUT_S", "SOCKET_NAME", "credentials", "open_transport"]

logger = logging.getLogger(__name__)

SOCKET_NAME = PoolSettings.SOCKET_NAME
#: Longest ``Ems.check_health()`` waits for a daemon before a successful init.
PROBE_TIMEOUT_S = 1.0
#: Errors of reaching the daemon that a later retry can fix.
_RETRYABLE = (EmsErrorCode.EMS_IO_ERROR, EmsErrorCode.EMS_IO_TIMEOUT,
              EmsErrorCode.EMS_RECOVERD_ERROR)


def credentials(config: EmsConfig) -> tuple[Optional[str], Optional[str]]:
    """``(access_id, access_key)`` to present, or ``(None, None)``: anonymous (an empty
    or None ``access_key``, whatever ``access_id`` says)."""
    if has_credentials(config):
        return config.access_id, config.access_key
    return None, None


def open_transport(settings: PoolSettings, config: EmsConfig) -> Transport:
    """Connect to the pool that ``settings`` selects."""
    sock = settings.socket_path
    mode = settings.resolved_mode()
    access_id, access_key = credentials(config)
    if access_id is None and config.access_id is not None:
        logger.info("ems: access_key is empty: no credentials, the anonymous namespace "
                    "(access_id %r is not used)", config.access_id)
    if mode == "embedded":
        from ems.client.embedded import EmbeddedTransport
        # Length-prefixed: ids may hold "/" and ":", and no id may end inside another's
        # namespace (tenant "a" saving "b/k" is not tenant "a/b" saving "k").
        tenant = f"{len(access_id)}:{access_id}/" if access_id else ""
        transport: Transport = EmbeddedTransport(settings.capacity_bytes, namespace=tenant)
        logger.info("ems: using the embedded pool (%d MiB, in this process)",
                    settings.capacity_bytes >> 20)
        return transport
    from ems.client.remote import RemoteTransport
    try:
        transport = RemoteTransport.connect(sock, access_id, access_key,
                                            settings.connect_timeout_ms / 1000.0,
                                            spin_s=settings.spin_us / 1e6)
    except EmsException as exc:
        if exc.status_code() in _RETRYABLE:
            raise EmsException(EmsErrorCode.EMS_RECOVERD_ERROR,
                               f"pool not available yet: {exc.message()}; retry Ems.init "
                               f"when Ems.check_health() is True") from exc
        raise
    logger.info("ems: using the ems-server daemon at %s", sock)
    return transport


def probe_pool(settings: PoolSettings) -> bool:
    """Whether the pool ``Ems.init`` would use with ``settings`` answers now (bounded by
    :data:`PROBE_TIMEOUT_S`; never raises)."""
    if settings.resolved_mode() == "embedded":
        return True
    from ems.client.channel import probe
    return probe(settings.socket_path,
                 min(PROBE_TIMEOUT_S, settings.connect_timeout_ms / 1000.0))


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
            cuda.configure(cuda.GpuSettings(register=settings.cuda_register,
                                            staging_bytes=settings.cuda_staging_bytes))
            transport = open_transport(settings, config)
            cc = None
            if config.cc_config is not None or config.cc_config_v1 is not None:
                cc = ContextCaching(transport, config.cc_config, config.cc_config_v1,
                                    workers=settings.workers,
                                    tenant=credentials(config)[0] or "")
            cls._config, cls._transport, cls._cc = config, transport, cc

    @classmethod
    def get_cc(cls) -> Optional[ContextCaching]:
        """The ContextCaching object; None before a successful init with a cc config."""
        return cls._cc

    @classmethod
    def check_health(cls) -> bool:
        """True when the pool answers. Never raises.

        After a successful init: the pool of this session (a daemon that restarted is
        reconnected to by this call). Before one (or after ``finalize``): whether the
        pool ``init`` would use answers now, so a client that got
        ``EMS_RECOVERD_ERROR`` knows when to call ``init`` again."""
        try:
            transport = cls._transport
            if transport is not None:
                return bool(transport.health())
            return probe_pool(PoolSettings.from_env())
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
