"""A mapped region of pool memory, seen by the client as an address and a tensor."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any, Optional

__all__ = ["Segment"]


class Segment:
    """Pool memory mapped into this process (an anonymous map for the embedded pool,
    a memfd handed over by the daemon otherwise)."""

    def __init__(self, segment_id: int, mm: mmap.mmap) -> None:
        self.id = segment_id
        self.size = len(mm)
        self._mm: Optional[mmap.mmap] = mm
        self._cbuf: Any = (ctypes.c_char * self.size).from_buffer(mm)
        self.address = ctypes.addressof(self._cbuf)
        self._tensor: Any = None
        self._windows: dict[tuple[Any, int], Any] = {}

    def tensor(self) -> Any:
        """The whole segment as a 1-D ``torch.uint8`` tensor sharing its memory."""
        if self._tensor is None:
            import torch
            self._tensor = torch.frombuffer(self._cbuf, dtype=torch.uint8)
        return self._tensor

    def window(self, dtype: Any, width: int) -> Any:
        """A ``[n, width]`` view whose row ``r`` starts at element ``r`` (not ``r*width``):
        row indices are element offsets, so one index op reaches objects anywhere."""
        key = (dtype, width)
        view = self._windows.get(key)
        if view is None:
            whole = self.tensor()
            # A segment whose size is not a multiple of the element size (an odd
            # EMS_CAPACITY) cannot be viewed as ``dtype``; its tail is never allocated
            # (the pool's capacity is rounded down to its alignment), so drop it.
            item = whole[:0].view(dtype).element_size()
            flat = whole[:whole.numel() - whole.numel() % item].view(dtype)
            view = flat.as_strided((flat.numel() - width + 1, width), (1, 1))
            self._windows[key] = view
        return view

    def close(self) -> None:
        """Unmap (after the last copy). Safe to call twice."""
        self._windows.clear()
        self._tensor = None
        self._cbuf = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a tensor view is still alive somewhere: let GC unmap
                pass
