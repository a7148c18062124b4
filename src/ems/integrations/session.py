"""The connector's pool session: one per process, shared by both connector roles.

``Ems`` is a process-wide singleton, and in vLLM's single-process mode the scheduler's
and the worker's connector live in one process, so neither may own it: both get this
session (``PoolSession.get``), which owns ``Ems.init``, the registered layout, the
deadlines and the health loop. States::

    DISCONNECTED --init + register ok--> UP <--health: pool answers, re-register--+
         |                               |                                        |
         +--init failed (one WARNING)--> DOWN <--a pool failure (one WARNING)-----+
                                          (every hook answers "no cache" at once)

* UP: lookups, loads and saves go to the pool, each within its deadline.
* DOWN: nothing is sent; lookups answer 0, loads fail (vLLM recomputes), saves are
  skipped. The health thread probes every ``health_interval_s`` with
  ``Ems.check_health()`` (which, before a successful ``Ems.init``, probes the daemon
  that init would use) and, when the pool answers, calls ``Ems.init`` again if
  needed (the EMS client's recovery after ``EMS_RECOVERD_ERROR``), registers the
  layout again, and goes UP with one INFO line.
* A pool failure is any ``EmsException`` but ``EMS_INVALID_ARGUMENT`` (that is a bug
  of ours: logged as an error, counted, the pool stays UP) and ``EMS_NO_SPACE`` (a
  full pool refuses saves; lookups and loads still work).

Layouts: the worker registers vLLM's real cache tensors; the scheduler (in its own
process in vLLM's default mode, without tensors) registers a *mirror*: tensors of
the same per-block shape and dtype with one block on the ``meta`` device (the SDK
registers their layout without memory), so that ``exists`` computes the same storage
keys as the worker's saves. A mirror never replaces a real registration in the same
process (this session skips it, and the SDK would keep the real one anyway).

The lookup deadline is kept here as well as given to the SDK: ``exists`` runs on a
small pool of threads and the caller waits at most ``lookup_timeout_ms``; when every
thread is stuck (a hung daemon) a lookup answers 0 without waiting. ``exists`` answers a
pool failure with 0 rather than raising, so a 0 that took the whole deadline counts as
the pool failing (a miss answers in well under a millisecond).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping, Optional, Sequence

from ems.client.context_caching import ContextCaching
from ems.client.cuda import EngineMark, ordered_after
from ems.client.singleton import Ems
from ems.config import CcKvOption, EmsConfig
from ems.errors import EmsErrorCode, EmsException, invalid
from ems.futures import CcFuture, CcResult
from ems.integrations.settings import PoolSettings

__all__ = ["WRITE_OUT_KEY", "PoolSession", "PoolState", "request_write_out"]

logger = logging.getLogger(__name__)

_LOOKUP_THREADS = 2
#: the key of a request's own ``write_out`` in vLLM's ``kv_transfer_params``
WRITE_OUT_KEY = "ems_write_out"


def request_write_out(params: Optional[Mapping[str, object]], default: bool) -> bool:
    """A request's ``CcKvOption.write_out``: ``params[WRITE_OUT_KEY]`` (a bool) where
    the request gives it, else ``default`` (the settings'). Anything but a bool is
    ``EMS_INVALID_ARGUMENT`` naming the key."""
    if not params or WRITE_OUT_KEY not in params:
        return default
    value = params[WRITE_OUT_KEY]
    if type(value) is not bool:
        raise invalid(f"kv_transfer_params[{WRITE_OUT_KEY!r}] must be a bool, "
                      f"got {type(value).__name__}")
    return value


class PoolState(enum.Enum):
    DISCONNECTED = "disconnected"
    UP = "up"
    DOWN = "down"


class PoolSession:
    """Process-wide: ``PoolSession.get(settings, config)``; see the module docstring."""

    _instance: Optional["PoolSession"] = None
    _instance_lock = threading.Lock()

    def __init__(self, settings: PoolSettings, config: EmsConfig) -> None:
        self.settings = settings
        self.config = config
        self._lock = threading.RLock()
        self.state = PoolState.DISCONNECTED
        self._layout: Optional[tuple[list[list[Any]], Optional[int],
                                     Optional[list[list[int]]]]] = None
        self._layout_real = False
        self._lookups = ThreadPoolExecutor(_LOOKUP_THREADS, thread_name_prefix="ems-lookup")
        self._lookups_busy = 0
        # One thread: saves of one step go in order, and a save never competes with
        # the next step's load for the daemon more than once.
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="ems-save")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._users = 0  # connectors (roles) holding this session
        self.failures = 0  # pool failures seen (each a call that got no cache)
        self.recoveries = 0
        self.last_error = ""

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def get(cls, settings: PoolSettings, config: EmsConfig) -> "PoolSession":
        with cls._instance_lock:
            inst = cls._instance
            if inst is not None and inst.config != config:
                # A new engine in this process (the old one's roles share one config).
                logger.info("ems: a connector with another config: a new pool session")
                inst._close_locked()
                inst = None
            if inst is None or inst._stop.is_set():
                inst = cls._instance = cls(settings, config)
                inst._start()
            inst._users += 1
            return inst

    def _start(self) -> None:
        settings = self.settings
        settings.export_pool_env()
        try:
            Ems.init(self.config)
        except EmsException as exc:
            self._go_down(f"Ems.init failed: {exc}")
        else:
            if Ems.get_cc() is None:
                self._go_down("Ems.init gave no ContextCaching")
            else:
                self.state = PoolState.UP
        self._thread = threading.Thread(target=self._health_loop, name="ems-health",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Drop one user; the last one stops the health loop and calls ``Ems.finalize``
        (which waits for requests in flight)."""
        with PoolSession._instance_lock:
            self._users -= 1
            if self._users > 0:
                return
            self._close_locked()

    def _close_locked(self) -> None:
        if PoolSession._instance is self:
            PoolSession._instance = None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._saver.shutdown(wait=True)
        Ems.finalize()

    # ------------------------------------------------------------ layout
    def register(self, kv_caches: list[list[Any]], block_size: Optional[int],
                 real: bool, groups: Optional[list[list[int]]] = None) -> None:
        """Register ``kv_caches`` (per layer, a list of tensors); ``block_size``: they
        are opaque pages of that many tokens (vLLM's CPU layout), None: paged;
        ``groups``: the layer indices of each KV cache group (the SDK's layer groups:
        each group's blocks have their own ids), None: one group."""
        with self._lock:
            if not real and self._layout_real:
                return  # the worker's real registration serves the scheduler too
            self._layout, self._layout_real = (kv_caches, block_size, groups), real
            if self.state is PoolState.UP:
                try:
                    self._register_now()
                except EmsException as exc:
                    self._failed(exc, "register_kvcache")
                except Exception as exc:  # noqa: BLE001 - never take the engine down
                    logger.exception("ems: register_kvcache failed")
                    self._go_down(f"register_kvcache failed: {exc!r}")

    def _register_now(self) -> None:
        cc = Ems.get_cc()
        if cc is None or self._layout is None:
            return
        caches, block_size, groups = self._layout
        cc.register_kvcache(caches, groups, block_size=block_size)

    @property
    def registered(self) -> bool:
        return self._layout is not None

    # ------------------------------------------------------------ requests
    def usable(self) -> Any:
        """The ContextCaching when the pool is UP (and, for a V1 config, a layout is
        registered), else None."""
        if self.state is not PoolState.UP or (
                self._layout is None and self.config.cc_config_v1 is not None):
            return None
        return Ems.get_cc()

    def lookup(self, hashes: Sequence[int | str], offsets: Optional[Sequence[int]] = None
               ) -> int:
        """Leading blocks of ``hashes`` (V1 hashes with their ``offsets``, or V0 keys
        without) in the pool; 0 past the deadline. Never raises."""
        cc = self.usable()
        if cc is None or not hashes:
            return 0
        timeout_ms = self.settings.lookup_timeout_ms
        with self._lock:
            if self._lookups_busy >= _LOOKUP_THREADS:
                return 0  # every lookup thread waits on a hung pool
            self._lookups_busy += 1
        option = CcKvOption(timeout=timeout_ms)
        t0 = time.monotonic()
        fut = self._lookups.submit(self._exists, cc, list(hashes),
                                   None if offsets is None else list(offsets), option)
        try:
            hits = int(fut.result(timeout=timeout_ms / 1000.0).success)
        except FutureTimeout:
            hits, timed_out = 0, True
        except EmsException as exc:
            self._failed(exc, "lookup")
            return 0
        else:
            # ``exists`` answers a pool failure with 0 instead of raising; a miss takes
            # well under a millisecond, so a 0 that took the whole deadline timed out
            timed_out = hits == 0 and time.monotonic() - t0 >= 0.9 * timeout_ms / 1000.0
        if timed_out:
            self._failed(EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                                      f"exists did not answer within {timeout_ms} ms"),
                         "lookup")
        return hits

    def _exists(self, cc: Any, hashes: list[int | str], offsets: Optional[list[int]],
                option: CcKvOption) -> Any:
        try:
            if offsets is None:
                return cc.exists(hashes, option)
            return cc.exists(hashes, option, offsets=offsets)
        finally:
            with self._lock:
                self._lookups_busy -= 1

    def request(self, what: str, call: Callable[[ContextCaching], CcResult]) -> int:
        """``call(cc)`` in the caller's thread (its option carries the deadline): the
        leading keys it did, 0 when the pool is not usable or it failed (counted; a
        pool failure takes the session DOWN). For a caller that already runs on its own
        I/O thread and needs the answer before it returns (SGLang's backup and prefetch
        threads)."""
        cc = self.usable()
        if cc is None:
            return 0
        try:
            return int(call(cc).success)
        except EmsException as exc:
            self._failed(exc, what)
            return 0

    def save(self, hashes: Sequence[int], chunk_descs: list[list[tuple[int, int]]],
             event_hashes: Optional[Sequence[int]] = None,
             after: Optional[EngineMark] = None, write_out: Optional[bool] = None
             ) -> Optional["Future[int]"]:
        """Save on this session's save thread (beside the engine); the future gives the
        leading blocks saved (0 when it failed: counted). None: the pool is not usable.
        ``chunk_descs``: per registered layer group, one ``(start_slot, length)`` per
        hash (the SDK's chunk_descs semantics: each group's blocks have their own ids);
        ``event_hashes``: the engine's own block hashes, which the daemon publishes in
        its KV events (None: none); ``after``: where the engine's writes of these
        blocks end on its stream (:func:`ems.client.cuda.engine_mark`, taken by the
        caller: the copies of a CUDA cache start after it, on a stream of their own);
        ``write_out``: the save's ``CcKvOption.write_out`` (None: the settings')."""
        cc = self.usable()
        if cc is None:
            return None
        option = self.settings.option("save", write_out)
        return self._saver.submit(self._save, cc, list(hashes), chunk_descs, option,
                                  None if event_hashes is None else list(event_hashes),
                                  after)

    def _save(self, cc: Any, hashes: list[int], chunk_descs: list[list[tuple[int, int]]],
              option: CcKvOption, event_hashes: Optional[list[int]],
              after: Optional[EngineMark] = None) -> int:
        try:
            with ordered_after(after):
                return int(cc.save(hashes=hashes, chunk_descs=chunk_descs, option=option,
                                   event_hashes=event_hashes).success)
        except EmsException as exc:
            self._failed(exc, "save")
            return 0

    def load(self, requests: Sequence[tuple[Sequence[int], list[list[tuple[int, int]]]]]
             ) -> list[int]:
        """Load every ``(hashes, chunk_descs)`` at once; per request the leading blocks
        loaded (0 when it failed). Waits for them: the SDK's deadline
        (``load_timeout_ms``) bounds each, and past it no byte is written."""
        cc = self.usable()
        if cc is None:
            return [0] * len(requests)
        option = CcKvOption(timeout=self.settings.load_timeout_ms)
        futures: list[Optional[CcFuture]] = []
        for hashes, chunk_descs in requests:
            try:
                futures.append(cc.async_load(hashes=list(hashes), chunk_descs=chunk_descs,
                                             option=option))
            except EmsException as exc:
                self._failed(exc, "load")
                futures.append(None)
        out = []
        for fut in futures:
            if fut is None:
                out.append(0)
                continue
            try:
                out.append(int(fut.result().success))
            except EmsException as exc:
                self._failed(exc, "load")
                out.append(0)
        return out

    # ------------------------------------------------------------ health
    def _failed(self, exc: EmsException, what: str) -> None:
        self.failures += 1
        self.last_error = f"{what}: {exc}"
        code = exc.status_code() if hasattr(exc, "status_code") else None
        if code is EmsErrorCode.EMS_INVALID_ARGUMENT:
            logger.error("ems: %s refused by the SDK (a bug of the connector): %s", what, exc)
            return
        if code is EmsErrorCode.EMS_NO_SPACE:
            logger.debug("ems: %s: the pool is full: %s", what, exc)
            return
        self._go_down(f"{what} failed: {exc}")

    def _go_down(self, reason: str) -> None:
        with self._lock:
            was = self.state
            self.state = PoolState.DOWN
        if was is not PoolState.DOWN:
            logger.warning("ems: the pool is unavailable (%s); serving without the cache, "
                           "probing every %.1f s", reason, self.settings.health_interval_s)

    def probe(self) -> bool:
        """One health step (the loop's body; tests call it directly). True when UP."""
        if self.state is PoolState.UP:
            if Ems.get_cc() is not None and Ems.check_health():
                return True
            self._go_down("the health check failed")
            return False
        if not Ems.check_health():
            return False
        try:
            if Ems.get_cc() is None:
                Ems.init(self.config)
            with self._lock:
                self._register_now()
                self.state = PoolState.UP
        except EmsException as exc:
            logger.debug("ems: the pool answers but re-init failed: %s", exc)
            return False
        self.recoveries += 1
        logger.info("ems: the pool is back; the cache is in use again")
        return True

    def _health_loop(self) -> None:
        while not self._stop.wait(self.settings.health_interval_s):
            try:
                self.probe()
            except Exception:  # noqa: BLE001 - the health loop never dies
                logger.exception("ems: health probe failed")

