"""ContextCaching: the V0 and V1 request API, one implementation behind sync and async.

Each request is validated and normalised (``ems.keys``) in the caller's thread, so
bad input raises at once and nothing is stored; then one function, ``_outcome``, runs
it: on one of this object's worker threads for ``async_save``/``async_load``
(``_execute`` publishes its result to the caller's :class:`CcFuture`), in the caller's
own thread for ``save``/``load`` (which block anyway; this saves two thread switches
per call, and the task's start / finish / wait, which nobody else can see). Deadlines, results and
errors are the same either way: ``save(...)`` behaves as ``async_save(...).result()``.

* save: ``Transport.save(request, task)`` stores the keys (how is the transport's:
  see ``ems.client.transport``) and says per key whether it is stored; keys already
  stored count as saved without a copy.
* load: ``Transport.load(request, task)`` copies the leading hits into the caller's
  memory and says how many. A key whose stored size differs from the request's is a
  miss and nothing is written for it; nothing after a miss is copied.

``CcResult.success`` counts consecutive successes from the start of the batch.
Many requests may be in flight; the object is safe to use from several threads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import ems.keys as _keys
from ems.client.layout import RegisteredLayout
from ems.client.movers import SAVE_SLICE_BYTES, V0Mover
from ems.client.transport import Transport
from ems.config import (
    CcConfig,
    CcConfig_v1,
    CcKvOption,
    KVCacheType,
    v1_from_v0,
    validate_option,
)
from ems.errors import EmsErrorCode, EmsException, invalid
from ems.futures import Cancelled, CcFuture, CcResult, Task
from ems.keys import PrimaryKey

__all__ = ["ContextCaching", "ContextCache_v1"]

logger = logging.getLogger(__name__)

_V1_WORDS = ("slot_mapping", "hashes", "offsets", "chunk_descs")
#: During an outage, ``exists`` warns at most this often.
_EXISTS_WARN_S = 10.0


class ContextCaching:
    """Save and load KV-cache blocks to and from the pool (get it from ``Ems.get_cc()``)."""

    def __init__(self, transport: Transport, cc_config: Optional[CcConfig],
                 cc_config_v1: Optional[CcConfig_v1], workers: int = 4,
                 tenant: str = "") -> None:
        self._transport = transport
        self._cc_config = cc_config
        self._cc_v1 = cc_config_v1
        self._tenant = tenant
        self._workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ems-cc")
        self._pid = os.getpid()
        self._layout: Optional[RegisteredLayout] = None
        self._v1_prefix = ""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inline = 0  # synchronous calls running in their callers' threads
        self._closed = False
        self._exists_failures = 0  # in a row (their warning is rate-limited)
        self._exists_warned_at = 0.0

    # ------------------------------------------------------------------ V1 setup
    def register_kvcache(self, kv_caches: Any, store_layer_group_desc: Any = None,
                         block_size: Any = None) -> None:
        """Register the paged KV cache (per layer, a list of tensors); see ``layout``.

        ``block_size=N`` registers opaque pages (every tensor's ``t[block_id]`` holds a
        block of ``N`` tokens in the layout's own order: NZ, vLLM's CPU layout); calls
        must then name whole blocks. Tensors on the ``meta`` device register the layout
        only (keys and ``exists``, for a scheduler process without KV memory); such a
        registration never replaces a real one of the same layout.

        With only a V0 ``cc_config`` at ``Ems.init`` (the official sample), the V1-only
        fields take their documented defaults (:func:`ems.config.v1_from_v0`)."""
        self._check_open()
        cfg = self._cc_v1
        if cfg is None:
            if self._cc_config is None:
                raise invalid("register_kvcache needs a cc_config or cc_config_v1 at "
                              "Ems.init")
            cfg = v1_from_v0(self._cc_config)
        try:
            import torch  # noqa: F401
        except ImportError:
            raise invalid("register_kvcache needs torch, which is not installed") from None
        layout = RegisteredLayout(kv_caches, store_layer_group_desc, block_size)
        tp = "mla" if cfg.kvcache_type == KVCacheType.MLA else (
            f"{cfg.tp_world_size}.{cfg.rank_in_tp_group}")
        ident = "\x1f".join([self._tenant, cfg.llm_engine, cfg.model_id,
                             f"pp{cfg.pp_world_size}.{cfg.rank_in_pp_group}", f"tp{tp}",
                             layout.fingerprint])
        prefix = hashlib.blake2b(ident.encode(), digest_size=12).hexdigest()
        with self._lock:
            old = self._layout
            if (layout.meta and old is not None and not old.meta
                    and old.fingerprint == layout.fingerprint):
                logger.debug("ems: a meta registration of the registered layout %s: kept "
                             "the registered memory", layout.fingerprint)
                return
            self._layout = layout
            self._v1_prefix = f"v1:{prefix}:"
        logger.info("ems: registered %d tensors in %d layer group(s), layout %s%s%s",
                    len(layout.tensors), len(layout.groups), layout.fingerprint,
                    " (opaque pages)" if any(g.opaque for g in layout.groups) else "",
                    " (meta: keys and exists only)" if layout.meta else "")

    # ------------------------------------------------------------------ requests
    def save(self, *args: Any, **kwargs: Any) -> CcResult:
        """V0 ``save(option, key_list, value_list)`` or V1 ``save(slot_mapping, hashes,
        offsets, option=None)`` / ``save(hashes=..., chunk_descs=..., option=None)``.
        An ems extension of V1 saves, keyword only: ``event_hashes=`` (one unsigned
        64-bit int per hash: the engine's own block hashes, which a daemon with KV
        events publishes for the blocks it stores).

        Runs the same ``_outcome`` as :meth:`async_save`, in the caller's thread: the
        caller blocks anyway, and handing a 1-key request to a worker and back costs
        two thread switches (~35-50 us of a ~100 us call on a loaded 2-core host)."""
        return self._run_here(self._normalize("save", args, kwargs))

    def load(self, *args: Any, **kwargs: Any) -> CcResult:
        """Same arguments as :meth:`save`; fills the caller's buffers / cache slots."""
        return self._run_here(self._normalize("load", args, kwargs))

    def async_save(self, *args: Any, **kwargs: Any) -> CcFuture:
        return self._submit(self._normalize("save", args, kwargs))

    def async_load(self, *args: Any, **kwargs: Any) -> CcFuture:
        return self._submit(self._normalize("load", args, kwargs))

    def exists(self, hashes: Any, option: Optional[CcKvOption] = None, **kwargs: Any
               ) -> CcResult:
        """How many leading blocks (V1 hashes) or V0 keys are in the pool; no copy, no pin.

        ``hashes`` is a list of V1 block hashes (ints) or of V0 keys (``str`` /
        ``PrimaryKey``, as ``save(option, key_list, value_list)`` takes them). Bad input
        raises ``EMS_INVALID_ARGUMENT``; a pool failure never raises: it answers
        ``success=0``. For V1 hashes ``kwargs`` may carry ``offsets`` or ``chunk_descs``,
        for V0 keys ``value_list``, to check that each was stored with that size.
        """
        validate_option(option, required=False)
        if (isinstance(hashes, (list, tuple)) and hashes
                and isinstance(hashes[0], (str, PrimaryKey))):
            return self._exists_v0(hashes, option, kwargs)
        hs = _keys.validate_hashes(hashes)
        layout, prefix = self._v1_state()
        sizes = None
        if "offsets" in kwargs or "chunk_descs" in kwargs:
            if "chunk_descs" in kwargs:
                chunks, hs = _keys.validate_chunk_descs(kwargs["chunk_descs"], hashes,
                                                        len(layout.groups))
                sizes = layout.plan_chunks(chunks).sizes
            else:
                sizes = layout.slot_sizes(_keys.validate_offsets(kwargs["offsets"], len(hs)))
        return CcResult(self._count_stored([prefix + str(h) for h in hs], sizes, option),
                        len(hs))

    def _exists_v0(self, key_list: Any, option: Optional[CcKvOption], kwargs: dict
                   ) -> CcResult:
        self._check_open()
        if set(kwargs) - {"value_list"}:
            raise invalid(f"exists with V0 keys takes value_list only, got "
                          f"{sorted(set(kwargs) - {'value_list'})}")
        storage_keys = _keys.v0_storage_keys(key_list)
        sizes = None
        if kwargs.get("value_list") is not None:
            sizes = _keys.validate_buffers(kwargs["value_list"], len(storage_keys))[1]
        return CcResult(self._count_stored(storage_keys, sizes, option), len(storage_keys))

    def _count_stored(self, storage_keys: list[str], sizes: Optional[list[int]],
                      option: Optional[CcKvOption]) -> int:
        """The transport's leading count; a pool failure answers 0 (and warns)."""
        try:
            n = self._transport.exists(storage_keys, sizes, option)
        except EmsException as exc:
            self._exists_failed(exc)
            return 0
        except Exception:  # noqa: BLE001 - exists never raises for pool failures
            logger.exception("ems: exists failed, answering 0")
            return 0
        self._exists_failures = 0
        return n

    def _exists_failed(self, exc: EmsException) -> None:
        """One warning per outage (a scheduler asks every step; the first failure after
        a success warns, then at most one line per :data:`_EXISTS_WARN_S` with the count)."""
        self._exists_failures += 1
        now = time.monotonic()
        if self._exists_failures == 1 or now - self._exists_warned_at >= _EXISTS_WARN_S:
            logger.warning("ems: exists failed, answering 0 (%d failure(s) in a row): %s",
                           self._exists_failures, exc)
            self._exists_warned_at = now

    def is_ready(self, future: CcFuture) -> bool:
        """Non-blocking: True once ``get_result(future)`` would not block."""
        if not isinstance(future, CcFuture):
            raise invalid(f"future must be a CcFuture, got {type(future).__name__}")
        return future.done()

    def get_result(self, future: CcFuture) -> CcResult:
        """``future.result()``."""
        if not isinstance(future, CcFuture):
            raise invalid(f"future must be a CcFuture, got {type(future).__name__}")
        return future.result()

    def statistics(self) -> Any:
        """Counters of the pool this object uses (a frozen dataclass)."""
        self._check_open()
        return self._transport.statistics()

    def close(self) -> None:
        """Wait for requests in flight, then stop the workers (``Ems.finalize`` calls it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._inline:  # the transport closes after us: let inline calls end
                self._idle.wait()
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED,
                               "this ContextCaching was closed by Ems.finalize")

    def _v1_state(self) -> tuple[RegisteredLayout, str]:
        with self._lock:
            layout, prefix = self._layout, self._v1_prefix
        if layout is None:
            raise invalid("V1 calls need register_kvcache(kv_caches) first")
        return layout, prefix

    def _normalize(self, op: str, args: tuple, kwargs: dict) -> _keys.Request:
        if self._closed:
            self._check_open()
        if not kwargs and args and type(args[0]) is CcKvOption:  # V0: the option first
            return self._normalize_v0(op, args, kwargs)
        # V1's first positional argument is slot_mapping (a list, or a tensor/array);
        # V0's is the option, so anything else there (None, a dict...) is a bad V0
        # option and gets the V0 error that names ``option``.
        if any(w in kwargs for w in _V1_WORDS) or (
                args and (isinstance(args[0], (list, tuple)) or hasattr(args[0], "tolist"))):
            return self._normalize_v1(op, args, kwargs)
        return self._normalize_v0(op, args, kwargs)

    def _normalize_v0(self, op: str, args: tuple, kwargs: dict) -> _keys.Request:
        if len(args) == 3 and not kwargs:  # how real clients call
            option, key_list, value_list = args
        else:
            bound = self._bind(op, ("option", "key_list", "value_list"), args, kwargs)
            option, key_list, value_list = (bound.get("option"), bound.get("key_list"),
                                            bound.get("value_list"))
        option = validate_option(option, required=True)
        storage_keys = _keys.v0_storage_keys(key_list)
        regions, sizes = _keys.validate_buffers(value_list, len(storage_keys))
        return _keys.Request(op, storage_keys, sizes, V0Mover(regions), option,
                             save_slice_bytes=SAVE_SLICE_BYTES)

    def _normalize_v1(self, op: str, args: tuple, kwargs: dict) -> _keys.Request:
        names = ("slot_mapping", "hashes", "offsets", "option", "chunk_descs")
        kwargs = dict(kwargs)
        events = kwargs.pop("event_hashes", None)  # keyword only: an ems extension
        bound = self._bind(op, names, args, kwargs)
        option = validate_option(bound.get("option"), required=False)
        layout, prefix = self._v1_state()
        if layout.meta:
            raise invalid(f"{op} needs KV memory: the registered kv_caches are meta tensors "
                          f"(a layout for keys and exists only); register the real tensors")
        has_slots = bound.get("slot_mapping") is not None or bound.get("offsets") is not None
        has_chunks = bound.get("chunk_descs") is not None
        if has_slots and has_chunks:
            raise invalid("use exactly one semantics: slot_mapping+hashes+offsets or "
                          "hashes+chunk_descs, not both")
        if has_chunks:
            chunks, hs = _keys.validate_chunk_descs(bound["chunk_descs"], bound.get("hashes"),
                                                    len(layout.groups))
            mover = layout.plan_chunks(chunks)
        elif has_slots:
            slots, hs, offs = _keys.validate_slot_request(
                bound.get("slot_mapping"), bound.get("hashes"), bound.get("offsets"))
            mover = layout.plan_slots(slots, offs)
        else:
            raise invalid("V1 calls need slot_mapping+hashes+offsets or hashes+chunk_descs")
        if events is not None:
            if op != "save":
                raise invalid(f"{op} takes no event_hashes (a save's KV-event hashes)")
            events = _keys.validate_event_hashes(events, len(hs))
        return _keys.Request(op, [prefix + str(h) for h in hs], mover.sizes, mover, option,
                             events)

    @staticmethod
    def _bind(op: str, names: tuple, args: tuple, kwargs: dict) -> dict[str, Any]:
        if len(args) > len(names):
            raise invalid(f"{op} takes at most {len(names)} positional arguments "
                          f"({', '.join(names)}), got {len(args)}")
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise invalid(f"{op} got an unexpected argument {k!r}; expected "
                              f"{', '.join(names)}")
            if k in bound:
                raise invalid(f"{op} got {k!r} both by position and by name")
            bound[k] = v
        return bound

    def _run_here(self, req: _keys.Request) -> CcResult:
        """A synchronous call: :meth:`_outcome` in the caller's thread. Nobody else
        sees its task (no waiter, no cancel), so it is not started, finished or waited
        on: ~1 us of locking per call of a ~15 us embedded save."""
        task = Task(req.option.timeout, req.op, len(req.keys))
        with self._lock:
            if self._closed:
                raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED,
                                   "this ContextCaching was closed by Ems.finalize")
            self._inline += 1
        try:
            return self._outcome(task, req, True)
        finally:
            with self._lock:
                self._inline -= 1
                if self._inline == 0 and self._closed:  # close() waits for this
                    self._idle.notify_all()

    def _submit(self, req: _keys.Request) -> CcFuture:
        task = Task(req.option.timeout, req.op, len(req.keys))
        if os.getpid() != self._pid:  # forked: the parent's worker threads are not here
            with self._lock:
                if os.getpid() != self._pid:
                    self._executor = ThreadPoolExecutor(max_workers=self._workers,
                                                        thread_name_prefix="ems-cc")
                    self._pid = os.getpid()
        try:
            self._executor.submit(self._execute, task, req, False)
        except RuntimeError:  # executor shut down between the check and the submit
            raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED,
                               "this ContextCaching was closed by Ems.finalize") from None
        return CcFuture(task)

    def _execute(self, task: Task, req: _keys.Request, spin: bool) -> None:
        """An asynchronous call on a worker: :meth:`_outcome`, published to its future."""
        if not task.start():
            return
        try:
            result = self._outcome(task, req, spin)
        except EmsException as exc:
            task.finish(None, exc)
        else:
            task.finish(result, None)

    def _outcome(self, task: Task, req: _keys.Request, spin: bool) -> CcResult:
        """Run one request on the transport's verb: its result, or an EmsException
        (the task's timeout once it was cancelled). ``spin``: a synchronous call in its
        caller's thread (the transport may poll for replies)."""
        try:
            if req.op == "save":
                stored = self._transport.save(req, task, spin)
                success = 0
                while success < len(stored) and stored[success]:
                    success += 1
            else:
                success = self._transport.load(req, task, spin)
                if not task.decide():
                    raise Cancelled
        except Cancelled:
            raise task.timeout_error() from None
        except EmsException:
            raise
        except Exception as exc:  # noqa: BLE001 - a worker never dies silently
            logger.exception("ems: %s failed", req.what)
            raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR,
                               f"{req.what} failed: {type(exc).__name__}: {exc}") from None
        return CcResult(success, len(req.keys))


#: The name real V1 clients use in type hints.
ContextCache_v1 = ContextCaching
