"""Every call into CUDA that the SDK makes, behind two small Protocols that tests fake.

Nothing else in ems calls the CUDA runtime or ``torch.cuda``; the planning that decides
*what* to copy (runs, staging chunks, registration chunks, event order) is pure code in
:mod:`ems.client.pinning` and :mod:`ems.client.staging`, unit-tested on the CPU with a
fake of these Protocols. Importing this module imports neither torch nor libcudart.

:class:`CudaRuntime` (host memory and V0 pointers) is the CUDA runtime loaded with
ctypes from the ``libcudart`` that torch's wheels ship (``nvidia/cuda_runtime/lib``)
or the system's. Why ctypes and not ``torch.cuda.cudart()``: torch exposes
``cudaHostRegister``/``cudaHostUnregister`` but not ``cudaMemcpyAsync``,
``cudaMemcpyBatchAsync``, streams by handle or ``cudaGetErrorString``, which the V0
path needs, and V0 users need no torch at all (the core SDK is importable without
it). The library torch loads and ours are the same file where torch came from a
wheel; where they differ, both talk to one driver and share its primary context, and
a registration (``cudaHostRegisterPortable``) is a property of the memory that every
context sees.

* ``host_register``: ``cudaHostRegister(ptr, n, cudaHostRegisterPortable)``. A refusal
  (containers without ``IPC_LOCK``, a memlock limit, devices without it) is returned
  as the runtime's message, not raised: the caller falls back to pageable copies.
* ``copy_runs``: V0 device pointers. One ``cudaMemcpyBatchAsync`` per call where the
  runtime has it (12.8+; its signature lost ``failIdx`` in 13.0), else one
  ``cudaMemcpyAsync`` per run, on this thread's stream, then one
  ``cudaStreamSynchronize``: the call returns when every byte has landed, so a
  deadline that passes afterwards has nothing in flight. The stream is created
  *blocking* (not ``cudaStreamNonBlocking``): like the synchronous ``cudaMemcpy`` it
  replaces, its copies wait for work queued before them on the legacy default
  stream, where an engine that hands out raw pointers usually writes them.

:class:`DeviceOps` (V1 CUDA tensors) is a thin layer over ``torch.cuda`` streams,
events and ``copy_(non_blocking=True)``, each call translated: a CUDA error (torch
raises ``RuntimeError``, or its ``AcceleratorError`` subclass) becomes
``EmsException(EMS_IO_ERROR)`` with the runtime's message. The engine marks where its
writes end with :func:`engine_mark` (an event on its current stream); a plan made
inside ``with ordered_after(mark):`` (on another thread: the vLLM connector's saver)
waits on that mark instead of recording its own.

Settings (:func:`configure`, called by ``Ems.init`` from
:class:`ems.config.PoolSettings`): ``EMS_CUDA_REGISTER`` (register pool memory,
default on) and ``EMS_CUDA_STAGING`` (bytes of device staging per direction).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import logging
import os
import threading
from typing import Any, Iterator, Optional, Protocol, Sequence

from ems.errors import EmsErrorCode, EmsException

__all__ = ["CudaRuntime", "DeviceOps", "EngineMark", "GpuSettings", "Run", "configure",
           "engine_mark", "io_error", "ordered_after", "runtime", "settings",
           "torch_ops"]

logger = logging.getLogger(__name__)

#: a torch tensor, stream or event (the core SDK is importable without torch)
Tensor = Any
Stream = Any
Event = Any


@dataclasses.dataclass(frozen=True)
class GpuSettings:
    """``register``: register pool memory with CUDA (``EMS_CUDA_REGISTER``);
    ``staging_bytes``: device staging per direction per device (``EMS_CUDA_STAGING``);
    ``register_chunk_bytes``: bytes per ``cudaHostRegister`` call (a stop waits for at
    most one: ~0.13-0.25 s at the 1-2 GB/s registration runs at)."""

    register: bool = True
    staging_bytes: int = 32 << 20
    register_chunk_bytes: int = 256 << 20


_settings = GpuSettings()


def configure(value: GpuSettings) -> None:
    """Set the process's GPU settings (``Ems.init``; tests)."""
    global _settings
    _settings = value


def settings() -> GpuSettings:
    return _settings


def io_error(what: str, message: str) -> EmsException:
    """A CUDA runtime error as the SDK reports it."""
    return EmsException(EmsErrorCode.EMS_IO_ERROR, f"CUDA {what} failed: {message}")


@dataclasses.dataclass(frozen=True)
class Run:
    """One byte range to copy: ``nbytes`` from address ``src`` to address ``dst``."""

    dst: int
    src: int
    nbytes: int


class CudaRuntime(Protocol):
    """What the host-memory and V0 paths ask of CUDA."""

    def device_of(self, address: int) -> Optional[int]:
        """The device whose memory ``address`` is (device or managed memory), else None
        (host memory, registered or not). Never dereferences it."""

    def host_register(self, device: int, address: int, nbytes: int) -> Optional[str]:
        """Register ``[address, +nbytes)`` (portable); None, or the runtime's refusal."""

    def host_unregister(self, device: int, address: int) -> None:
        """Undo one :meth:`host_register` of the range starting at ``address``."""

    def copy_runs(self, device: int, runs: Sequence[Run]) -> None:
        """Copy every run (host <-> device) and return when all have landed; raises
        ``EMS_IO_ERROR`` with the runtime's message."""


class _Attrs(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


class _Cudart:
    """:class:`CudaRuntime` over libcudart (ctypes)."""

    _MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (UVA)
    _HOST_TYPES = (0, 1)  # cudaMemoryTypeUnregistered, cudaMemoryTypeHost
    _REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
    _ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream

    def __init__(self, lib: ctypes.CDLL, version: int) -> None:
        self._lib = lib
        self.version = version
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaPointerGetAttributes.argtypes = [vp, vp]
        lib.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [vp]
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaStreamCreate.argtypes = [vp]
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None) if version >= 12080 else None
        if self._batch is not None:
            head = [vp, vp, vp, sz, vp, vp, sz]
            self._batch.argtypes = head + ([vp] if version >= 13000 else [vp, vp])
        self._local = threading.local()  # per thread: {device: stream}

    def _message(self, rc: int) -> str:
        text = self._lib.cudaGetErrorString(rc)
        return f"{text.decode(errors='replace') if text else 'unknown error'} (code {rc})"

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self._lib.cudaGetLastError()  # (clear it: the next call must not report it)
            raise io_error(what, self._message(rc))

    def device_of(self, address: int) -> Optional[int]:
        attrs = _Attrs()
        rc = self._lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(address))
        if rc != 0:
            self._lib.cudaGetLastError()  # old runtimes: an unknown pointer is an error
            return None
        return None if attrs.type in self._HOST_TYPES else int(attrs.device)

    def host_register(self, device: int, address: int, nbytes: int) -> Optional[str]:
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        rc = self._lib.cudaHostRegister(ctypes.c_void_p(address), nbytes,
                                        self._REGISTER_PORTABLE)
        if rc != 0:
            self._lib.cudaGetLastError()
            return self._message(rc)
        return None

    def host_unregister(self, device: int, address: int) -> None:
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        self._check(self._lib.cudaHostUnregister(ctypes.c_void_p(address)),
                    "cudaHostUnregister")

    def _stream(self, device: int) -> ctypes.c_void_p:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        stream = streams.get(device)
        if stream is None:  # one per thread and device, for the thread's life
            stream = ctypes.c_void_p()
            self._check(self._lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
            streams[device] = stream
        return stream

    def copy_runs(self, device: int, runs: Sequence[Run]) -> None:
        if not runs:
            return
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        stream = self._stream(device)
        if self._batch is not None and len(runs) > 1:
            n = len(runs)
            dsts = (ctypes.c_void_p * n)(*[r.dst for r in runs])
            srcs = (ctypes.c_void_p * n)(*[r.src for r in runs])
            sizes = (ctypes.c_size_t * n)(*[r.nbytes for r in runs])
            attrs = _MemcpyAttributes(srcAccessOrder=self._ORDER_STREAM)
            index = (ctypes.c_size_t * 1)(0)
            args: list[Any] = [dsts, srcs, sizes, n, ctypes.byref(attrs), index, 1]
            if self.version < 13000:
                args.append(ctypes.byref(ctypes.c_size_t(0)))  # failIdx (12.8-12.9)
            rc = self._batch(*args, stream)
            if rc == 0:
                self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                return
            # A runtime that lists the call but refuses our use of it: per-run copies
            # from now on (logged once), the same bytes.
            self._lib.cudaGetLastError()
            logger.warning("ems: cudaMemcpyBatchAsync refused (%s); V0 device copies use "
                           "cudaMemcpyAsync per run", self._message(rc))
            self._batch = None
        for r in runs:
            self._check(self._lib.cudaMemcpyAsync(ctypes.c_void_p(r.dst), ctypes.c_void_p(r.src),
                                                  r.nbytes, self._MEMCPY_DEFAULT, stream),
                        "cudaMemcpyAsync")
        self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def _load_cudart() -> Optional[ctypes.CDLL]:
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    try:  # torch wheels ship their runtime under nvidia/cuda_runtime/lib (or nvidia/cu13)
        import nvidia  # type: ignore[import-not-found,unused-ignore]
        for path in getattr(nvidia, "__path__", []):
            names[:0] = sorted(glob.glob(os.path.join(path, "*", "lib", "libcudart.so*")))
    except ImportError:
        pass
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_runtime: Optional[CudaRuntime] = None
_probed = False
_probe_lock = threading.Lock()


def runtime() -> Optional[CudaRuntime]:
    """The CUDA runtime if this process sees a GPU, else None (probed once; the probe,
    ``cudaGetDeviceCount``, creates no context)."""
    global _runtime, _probed
    if _probed:
        return _runtime
    with _probe_lock:
        if not _probed:
            lib = _load_cudart()
            if lib is not None:
                count, version = ctypes.c_int(0), ctypes.c_int(0)
                try:
                    if lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
                        lib.cudaRuntimeGetVersion(ctypes.byref(version))
                        _runtime = _Cudart(lib, version.value)
                        logger.info("ems: CUDA runtime %d found (%d device(s))",
                                    version.value, count.value)
                except AttributeError:
                    pass
            _probed = True
    return _runtime


def install_runtime(value: Optional[CudaRuntime]) -> None:
    """Use ``value`` as the process's runtime (tests install a fake; None: no CUDA)."""
    global _runtime, _probed
    with _probe_lock:
        _runtime, _probed = value, True


# --------------------------------------------------------------------------- V1 (torch)

class DeviceOps(Protocol):
    """What the V1 device path asks of a device: streams, events, asynchronous copies
    and device staging memory. :func:`torch_ops` is the CUDA one."""

    def caller_stream(self, device: Any) -> Stream:
        """The calling thread's current stream on ``device`` (the engine's)."""

    def new_stream(self, device: Any) -> Stream:
        """A side stream of ours."""

    def record(self, stream: Stream) -> Event:
        """An event recorded now on ``stream``."""

    def wait(self, stream: Stream, event: Event) -> None:
        """Work queued on ``stream`` from now on starts after ``event``."""

    def synchronize(self, event: Event) -> None:
        """Block this thread until ``event`` has happened."""

    def on(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Torch work inside the block is queued on ``stream``."""

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """``dst.copy_(src)``, asynchronous where the memory allows (inside :meth:`on`)."""

    def staging(self, device: Any, nbytes: int) -> Tensor:
        """A 1-D uint8 tensor of ``nbytes`` on ``device``."""

    def upload(self, host: Tensor, device: Any) -> Tensor:
        """``host`` (a small CPU tensor: indices) on ``device``, queued on the current
        stream without waiting for the work queued before it."""

    def translate(self) -> contextlib.AbstractContextManager[None]:
        """Device errors raised inside the block become ``EMS_IO_ERROR``."""


class _TorchCuda:
    """:class:`DeviceOps` over ``torch.cuda``."""

    def __init__(self) -> None:
        import torch
        self._torch = torch

    def caller_stream(self, device: Any) -> Stream:
        return self._torch.cuda.current_stream(device)

    def new_stream(self, device: Any) -> Stream:
        with self.translate():
            return self._torch.cuda.Stream(device=device)

    def record(self, stream: Stream) -> Event:
        with self.translate():
            event = self._torch.cuda.Event()
            event.record(stream)
            return event

    def wait(self, stream: Stream, event: Event) -> None:
        with self.translate():
            stream.wait_event(event)

    def synchronize(self, event: Event) -> None:
        with self.translate():
            event.synchronize()

    def on(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        return self._torch.cuda.stream(stream)  # type: ignore[no-any-return,unused-ignore]

    def copy(self, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def staging(self, device: Any, nbytes: int) -> Tensor:
        with self.translate():
            return self._torch.empty(nbytes, dtype=self._torch.uint8, device=device)

    def upload(self, host: Tensor, device: Any) -> Tensor:
        # From pinned memory (torch's caching host allocator, which keeps the block
        # until the copy is done): a copy from pageable memory may synchronize the
        # stream first, which would stall the queue of chunks at every chunk.
        return host.pin_memory().to(device, non_blocking=True)

    @contextlib.contextmanager
    def translate(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # (torch.AcceleratorError is one)
            raise io_error("call", str(exc)) from exc


_ops: Optional[DeviceOps] = None


def torch_ops() -> DeviceOps:
    """The CUDA :class:`DeviceOps` (made once; needs torch with CUDA)."""
    global _ops
    if _ops is None:
        _ops = _TorchCuda()
    return _ops


@dataclasses.dataclass(frozen=True)
class EngineMark:
    """Where an engine's writes end: an event recorded on its stream."""

    stream: Stream
    event: Event


_marks = threading.local()


def engine_mark(ops: DeviceOps, device: Any) -> EngineMark:
    """An event recorded now on the calling thread's current stream of ``device``."""
    stream = ops.caller_stream(device)
    return EngineMark(stream, ops.record(stream))


@contextlib.contextmanager
def ordered_after(mark: Optional[EngineMark]) -> Iterator[None]:
    """V1 requests planned in this block (this thread) start after ``mark`` and, for
    loads, make ``mark.stream`` wait for their bytes (None: no effect)."""
    previous = getattr(_marks, "mark", None)
    _marks.mark = mark if mark is not None else previous
    try:
        yield
    finally:
        _marks.mark = previous


def current_mark() -> Optional[EngineMark]:
    """The mark of the innermost :func:`ordered_after` of this thread, if any."""
    mark: Optional[EngineMark] = getattr(_marks, "mark", None)
    return mark
