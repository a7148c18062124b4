"""Byte copies between the caller's host memory and pool memory.

Host pointers are copied by the native helper's ``copy`` (``ems._native``: streaming
stores from 4 KiB on; a Python function, not a ctypes call: ~0.1 us per call against
~0.5-1.1 us; it releases the GIL for runs of 64 KiB and more, so several requests copy
in parallel), or by ``ctypes.memmove`` where the helper was not built. Device
pointers never come here: :class:`ems.client.movers.V0Mover` sends them, batched, to
the CUDA runtime (:mod:`ems.client.cuda`), and they are never dereferenced on the
host. Ascend NPU pointers need the CANN runtime, which this project cannot load or
test; V1 (torch tensors) works on any device torch supports.

``copy_bytes`` is looked up at call time (``copy.copy_bytes``), so tests can slow it
down to exercise timeouts without touching the product's code paths.
"""

from __future__ import annotations

import ctypes

from ems.client.native import copy_one

__all__ = ["copy_bytes"]

#: one host run: the native copy, or memmove without the helper
_host_copy = copy_one if copy_one is not None else ctypes.memmove


def copy_bytes(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from host address ``src`` to host address ``dst``."""
    _host_copy(dst, src, n)
