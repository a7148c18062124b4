"""Byte copies between the caller's memory and pool memory.

Host pointers are copied by the native helper's ``copy`` (``ems._native``: streaming
stores from 4 KiB on; a Python function, not a ctypes call: ~0.1 us per call against
~0.5-1.1 us; it releases the GIL for runs of 64 KiB and more, so several requests copy
in parallel), or by ``ctypes.memmove`` where the helper was not built. Where the
process has CUDA, a pointer is classified with ``cudaPointerGetAttributes`` and a
device (or managed) pointer is copied with ``cudaMemcpy(..., cudaMemcpyDefault)``: it
is never dereferenced on the host. Ascend NPU pointers need the CANN runtime, which
this project cannot load or test; V1 (torch tensors) works on any device torch supports.

``copy_bytes`` is looked up at call time (``copy.copy_bytes``), so tests can slow it
down to exercise timeouts without touching the product's code paths.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional

from ems.client.native import copy_one

__all__ = ["copy_bytes", "cuda_runtime"]

logger = logging.getLogger(__name__)

#: one host run: the native copy, or memmove without the helper
_host_copy = copy_one if copy_one is not None else ctypes.memmove


class _CudaRuntime:
    """The few CUDA runtime entry points we need, loaded with ctypes."""

    _MEMCPY_DEFAULT = 4
    _HOST_TYPES = (0, 1)  # cudaMemoryTypeUnregistered, cudaMemoryTypeHost

    class _Attrs(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                    ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.cudaPointerGetAttributes.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_int]
        lib.cudaGetLastError.restype = ctypes.c_int

    def is_device(self, ptr: int) -> bool:
        attrs = self._Attrs()
        rc = self._lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        if rc != 0:
            self._lib.cudaGetLastError()  # clear the sticky-free error of old runtimes
            return False
        return attrs.type not in self._HOST_TYPES

    def memcpy(self, dst: int, src: int, n: int) -> None:
        rc = self._lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), n,
                                  self._MEMCPY_DEFAULT)
        if rc != 0:
            from ems.errors import EmsErrorCode, EmsException
            raise EmsException(EmsErrorCode.EMS_IO_ERROR, f"cudaMemcpy failed with code {rc}")


_cuda: Optional[_CudaRuntime] = None
_cuda_probed = False
_probe_lock = threading.Lock()


def _load_cudart() -> Optional[ctypes.CDLL]:
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    try:  # torch wheels ship their runtime under nvidia/cuda_runtime/lib
        import glob
        import os

        import nvidia.cuda_runtime as _rt  # type: ignore[import-not-found]
        for path in getattr(_rt, "__path__", []):
            names[:0] = sorted(glob.glob(os.path.join(path, "lib", "libcudart.so*")))
    except ImportError:
        pass
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_runtime() -> Optional[_CudaRuntime]:
    """The CUDA runtime if this process has a usable GPU, else None (probed once)."""
    global _cuda, _cuda_probed
    if _cuda_probed:
        return _cuda
    with _probe_lock:
        if not _cuda_probed:
            lib = _load_cudart()
            if lib is not None:
                count = ctypes.c_int(0)
                try:
                    if lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
                        _cuda = _CudaRuntime(lib)
                        logger.info("ems: CUDA runtime found (%d device(s)); V0 device "
                                    "pointers are copied with cudaMemcpy", count.value)
                except AttributeError:
                    pass
            _cuda_probed = True
    return _cuda


def copy_bytes(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (host or device)."""
    cuda = _cuda if _cuda_probed else cuda_runtime()
    if cuda is not None and (cuda.is_device(dst) or cuda.is_device(src)):
        cuda.memcpy(dst, src, n)
    else:
        _host_copy(dst, src, n)
