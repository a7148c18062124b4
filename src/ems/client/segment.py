"""A mapped region of pool memory, seen by the client as an address and a tensor.

A segment of a daemon's pool lives as long as its connection, plus the copies that
were running when the connection was replaced::

    MAPPED --retire() (a new connection mapped the new pool)--> RETIRED
       |                                                           | last copy ends
       +--close()--------------------------------------------------+--> UNMAPPED

(``close`` unregisters the segment from CUDA, where a device copy registered it,
before it unmaps: :mod:`ems.client.pinning`.)

Copies run inside ``with segment.use():`` (the movers), so ``retire`` never unmaps
memory a copy is writing: a copy that started before the daemon died finishes from
this mapping (which stays valid), and the mapping goes with the last one. Relying on
the garbage collector instead left the old pool mapped after every daemon restart
(an exception a client kept held the old session through its traceback): a host held
two pools' worth of shared memory.

The copies in flight are counted without a lock: ``use()`` appends to a list and its
end pops, both atomic under the GIL, and ``retire`` marks the segment *before* it
looks at the count, while a copy looks at the mark *after* it counted itself; so
either the retirer sees the copy (and the copy's end unmaps) or the copy sees the mark
(and backs out before touching the memory). Entering and leaving cost ~0.3 us, where
a lock-guarded counter cost ~1.0 us of a ~12 us save.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any, Optional

from ems.client import cuda
from ems.client.pinning import Pinning
from ems.errors import EmsErrorCode, EmsException

__all__ = ["Segment", "window"]


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
        self._lock = threading.Lock()  # close() only
        self._users: list[None] = []  # one entry per copy in flight
        self._retired = False  # no new copy starts (set by retire and close)
        self._use = _Use(self)
        #: its registration with CUDA (started by the first device copy: :meth:`pin`)
        self.pinning = Pinning(self.address, self.size, cuda.settings().register_chunk_bytes)

    def pin(self, device: int) -> None:
        """A copy to or from ``device`` is about to use this segment: register it with
        CUDA in the background, unless ``EMS_CUDA_REGISTER=0`` (see
        :mod:`ems.client.pinning`; a no-op after the first call)."""
        if cuda.settings().register:
            self.pinning.start(device)

    def use(self) -> "_Use":
        """``with segment.use():`` holds the mapping for a copy (raises ``EMS_IO_ERROR``
        once it is unmapped). A plain object with ``__enter__``/``__exit__``: a
        ``contextlib.contextmanager`` generator cost ~1.5 us per call of a ~12 us save."""
        return self._use

    def retire(self) -> None:
        """Unmap as soon as no copy uses the mapping (now, when none does)."""
        self._retired = True
        if not self._users:
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
            view = self._windows[key] = window(self.tensor(), dtype, width)
        return view

    def close(self) -> None:
        """Unmap (after the last copy). Safe to call twice, from two threads."""
        self._retired = True
        with self._lock:
            mm, self._mm = self._mm, None
            if mm is None:
                return
        self.pinning.release()  # (CUDA must let go of the pages before they are unmapped)
        self._windows.clear()
        self._tensor = None
        self._cbuf = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a tensor view is still alive somewhere: let GC unmap
                pass


def window(whole: Any, dtype: Any, width: int) -> Any:
    """A ``[n, width]`` view of the 1-D uint8 tensor ``whole`` as ``dtype`` whose row
    ``r`` starts at element ``r`` (see :meth:`Segment.window`; device staging too)."""
    # A segment whose size is not a multiple of the element size (an odd
    # EMS_CAPACITY) cannot be viewed as ``dtype``; its tail is never allocated
    # (the pool's capacity is rounded down to its alignment), so drop it.
    item = whole[:0].view(dtype).element_size()
    flat = whole[:whole.numel() - whole.numel() % item].view(dtype)
    return flat.as_strided((flat.numel() - width + 1, width), (1, 1))


class _Use:
    """What ``Segment.use()`` returns (one per segment, reused)."""

    __slots__ = ("_segment",)

    def __init__(self, segment: Segment) -> None:
        self._segment = segment

    def __enter__(self) -> Segment:
        segment = self._segment
        segment._users.append(None)
        if segment._retired:  # (looked at after counting itself: see the module doc)
            self.__exit__()
            raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                               "the pool memory of a lost ems-server connection was "
                               "released; retry the call")
        return segment

    def __exit__(self, *exc: object) -> None:
        segment = self._segment
        segment._users.pop()
        if segment._retired and not segment._users:  # the last copy of a retired one
            segment.close()
