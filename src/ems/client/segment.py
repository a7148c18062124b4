"""A mapped region of pool memory, seen by the client as an address and a tensor.

A segment of a daemon's pool lives as long as its connection, plus the copies that
were running when the connection was replaced::

    MAPPED --retire() (a new connection mapped the new pool)--> RETIRED
       |                                                           | last copy ends
       +--close()--------------------------------------------------+--> UNMAPPED

Copies run inside ``with segment.use():`` (the movers), so ``retire`` never unmaps
memory a copy is writing: a copy that started before the daemon died finishes from
this mapping (which stays valid), and the mapping goes with the last one. Relying on
the garbage collector instead left the old pool mapped after every daemon restart
(an exception a client kept held the old session through its traceback): a host held
two pools' worth of shared memory.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any, Optional

from ems.errors import EmsErrorCode, EmsException

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
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False
        self._use = _Use(self)

    def use(self) -> "_Use":
        """``with segment.use():`` holds the mapping for a copy (raises ``EMS_IO_ERROR``
        once it is unmapped). A plain object with ``__enter__``/``__exit__``: a
        ``contextlib.contextmanager`` generator cost ~1.5 us per call of a ~12 us save."""
        return self._use

    def _enter(self) -> None:
        with self._lock:
            if self._mm is None:
                raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                                   "the pool memory of a lost ems-server connection was "
                                   "released; retry the call")
            self._users += 1

    def _exit(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._retired and self._users == 0
        if last:
            self.close()

    def retire(self) -> None:
        """Unmap as soon as no copy uses the mapping (now, when none does)."""
        with self._lock:
            self._retired = True
            idle = self._users == 0
        if idle:
            self.close()

    @property
    def mapped(self) -> bool:
        return self._mm is not None

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


class _Use:
    """What ``Segment.use()`` returns (one per segment, reused)."""

    __slots__ = ("_segment",)

    def __init__(self, segment: Segment) -> None:
        self._segment = segment

    def __enter__(self) -> Segment:
        self._segment._enter()
        return self._segment

    def __exit__(self, *exc: object) -> None:
        self._segment._exit()
