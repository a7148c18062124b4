"""The optional native bulk copy (``ems._native``, see ``src/ems/_native.c``).

``copy_one(dst, src, n)`` copies one run (the module's own function: no ctypes call).
``copy_runs(dst, src, lengths)`` copies run ``i`` of ``lengths[i]`` bytes from address
``src[i]`` to ``dst[i]``, for int64 tensors of addresses, in one C loop with the GIL
released; ``copy_table`` does the same for rows of such arrays given by address.
``available()`` is False where the extension was not built (no compiler); callers
then use torch's gather/scatter and ``ctypes.memmove``.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

__all__ = ["available", "copy_one", "copy_runs", "copy_table"]

_fn: Optional[Any] = None
#: ``copy_one(dst_address, src_address, n)``: one run (None without the extension)
copy_one: Optional[Any] = None
try:
    import importlib

    _module = importlib.import_module("ems._native")
    _lib = ctypes.CDLL(str(_module.__file__))
    _fn = _lib.ems_copy_runs
    _fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_int64]
    _fn.restype = None
    copy_one = _module.copy
except (ImportError, OSError, AttributeError):  # pragma: no cover - no compiler at install
    _fn = None


def available() -> bool:
    return _fn is not None


def copy_table(dst: int, src: int, lengths: int, n: int) -> None:
    """Rows ``[0, n)`` of a run table given by the addresses of its three int64 arrays
    (``dst``, ``src``, ``lengths``): a chunk of a table without slicing tensors."""
    assert _fn is not None
    if n > 0:
        _fn(dst, src, lengths, n, 0)


def copy_runs(dst: Any, src: Any, lengths: Any) -> None:
    """``dst``, ``src``: contiguous int64 CPU tensors of addresses; ``lengths``: an int
    (every run) or an int64 tensor of the same length."""
    assert _fn is not None
    dst = dst.contiguous()
    src = src.contiguous()
    n = dst.numel()
    if n == 0:
        return
    if isinstance(lengths, int):
        one = ctypes.c_int64(lengths)
        _fn(dst.data_ptr(), src.data_ptr(), ctypes.addressof(one), n, 1)
    else:
        lengths = lengths.contiguous()
        _fn(dst.data_ptr(), src.data_ptr(), lengths.data_ptr(), n, 0)
