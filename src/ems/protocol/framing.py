"""Frames: a fixed header, then a msgpack body. Bytes in, messages out; no sockets.

A frame is::

    +-------+---------+-------+----------------+------------------+
    | "EM"  | version | flags | length (u32 BE) | msgpack body ... |
    +-------+---------+-------+----------------+------------------+
      2 B      1 B      1 B        4 B            length bytes

* ``version`` is :data:`PROTOCOL_VERSION`; a peer that sees another version answers
  one :class:`~ems.protocol.messages.Error` frame and closes the connection (it never
  guesses at a body it may not understand).
* ``flags`` is reserved and must be 0.
* ``length`` is at most :data:`MAX_FRAME_BYTES`: a peer never buffers more than that
  for one message, whatever the other side claims.

:class:`FrameDecoder` is the receiving half (h11 style): ``feed()`` the bytes that
arrived, then iterate to get every complete message. Any violation raises
``EmsException(EMS_PROTOCOL_ERROR)`` once and leaves the decoder failed: the only
sane reaction to a corrupt stream is to close it.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Iterator, Optional

import msgpack

from ems.errors import EmsErrorCode, EmsException
from ems.protocol.messages import MESSAGES, Message, from_wire

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_FRAME_BYTES",
    "NOTHING",
    "PROTOCOL_VERSION",
    "DecodeLimitExceeded",
    "FrameDecoder",
    "encode",
    "encode_wire",
    "protocol_error",
]

MAGIC = b"EM"
PROTOCOL_VERSION = 5  # 2: leases (Lease, Put, Return); 3: Welcome.max_keys, Ping before Hello;
#  4: request options (write_rcache, local_only, budget_ms: the cluster tier);
#  5: Welcome.align and Welcome.lease_size (the client no longer assumes either)
HEADER = struct.Struct(">2sBBI")  # 8 bytes
_pack_header = HEADER.pack
_unpack_header = HEADER.unpack_from
_local = threading.local()
_unpackb = msgpack.unpackb
_LIMIT_NAMES = ("max_array_len", "max_str_len", "max_bin_len", "max_map_len", "max_ext_len")
#: ``next_body()``'s answer when no complete frame is buffered (a body may decode to
#: None, so None cannot say it)
NOTHING = object()
#: Largest body either side accepts (a batch of ~250k keys of 128 bytes fits).
MAX_FRAME_BYTES = 32 << 20


def protocol_error(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, message)


class DecodeLimitExceeded(EmsException):
    """A body past the decoder's :attr:`~FrameDecoder.unpack_limits` (an
    ``EMS_PROTOCOL_ERROR`` like any bad body; its own type so that the daemon counts it
    as a refusal by a bound, not as junk)."""

    def __init__(self, message: str) -> None:
        super().__init__(EmsErrorCode.EMS_PROTOCOL_ERROR, message)


def _past_a_limit(exc: Exception) -> bool:
    """Whether msgpack refused a body for one of the ``max_*_len`` bounds. msgpack (1.0 to
    1.2) gives that refusal no type of its own: a plain ``ValueError`` ("N exceeds
    max_str_len(M)"), as for a truncated body or a non-str map key. Its text is read
    here, beside the one call, and ``tests/unit/test_protocol.py`` pins it for every
    bound, so an msgpack that words it otherwise fails that test instead of a counter."""
    return type(exc) is ValueError and " exceeds max_" in str(exc)


def encode(message: Message, version: int = PROTOCOL_VERSION) -> bytes:
    """One frame holding ``message`` (``version`` is only overridden by tests)."""
    return encode_wire(message.to_wire(), version)


def encode_wire(wire: list[Any], version: int = PROTOCOL_VERSION) -> bytes:
    """One frame holding a message in its wire form, ``[TYPE, field, ...]`` (the
    daemon answers this way without building reply objects)."""
    packer = getattr(_local, "packer", None)
    if packer is None:  # one per thread: a Packer is not thread-safe, and is reused
        packer = _local.packer = msgpack.Packer(use_bin_type=True)  # (packb builds one)
    try:
        body = packer.pack(wire)
    except BaseException:
        _local.packer = None  # a failed pack may leave bytes in its buffer
        raise
    if len(body) > MAX_FRAME_BYTES:
        name = getattr(MESSAGES.get(wire[0]), "__name__", "message")
        raise protocol_error(f"{name} is {len(body)} bytes, more than the "
                             f"{MAX_FRAME_BYTES} a frame may hold; split the batch")
    return _pack_header(MAGIC, version, 0, len(body)) + body


class FrameDecoder:
    """Incremental decoder of a byte stream into messages."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        #: largest body accepted; may be raised later (the daemon keeps it small
        #: until a connection has authenticated)
        self.max_frame_bytes = max_frame_bytes
        self._limits: dict[str, int] = {}
        self._limits5: Optional[tuple[int, int, int, int, int]] = None
        self._failed: Optional[EmsException] = None

    @property
    def unpack_limits(self) -> dict[str, int]:
        """msgpack's bounds on what a body may hold (``max_array_len``,
        ``max_str_len``, ...): a body past them fails at the header of the element,
        before it is built (a 1M-element list: 0.2 ms instead of ~60 ms of decoding)."""
        return dict(self._limits)

    @unpack_limits.setter
    def unpack_limits(self, limits: dict[str, int]) -> None:
        self._limits = dict(limits)
        # All five given (the daemon's): passed as explicit keywords, which msgpack
        # takes in ~0.28 us a body against ~0.5-0.8 for a ``**`` dict.
        self._limits5 = (tuple(limits[k] for k in _LIMIT_NAMES)  # type: ignore[assignment]
                         if set(limits) == set(_LIMIT_NAMES) else None)

    def feed(self, data: bytes) -> None:
        """Append bytes received from the peer."""
        if self._failed is None:
            self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a message."""
        return len(self._buf)

    def next_message(self) -> Optional[Message]:
        """The next complete message, or None until more bytes arrive."""
        body = self.next_body()
        return None if body is NOTHING else self._message(body)

    def __iter__(self) -> Iterator[Message]:
        while True:
            body = self.next_body()
            if body is NOTHING:
                return
            yield self._message(body)

    def _message(self, body: Any) -> Message:
        try:
            return from_wire(body)
        except EmsException as exc:  # a bad message fails the stream, as a bad frame does
            self._failed = exc
            self._buf.clear()
            raise

    def bodies(self, data: bytes) -> list[Any]:
        """Feed ``data`` and return the decoded body (unchecked, as :meth:`next_body`)
        of every frame now complete, in one call. A corrupt frame after good ones: the
        good ones are returned and :attr:`failed` is set (the next call raises it).

        The usual case, nothing buffered and ``data`` exactly one frame, is decoded
        straight from ``data`` (no copy into the buffer and out again: ~0.8 of the
        ~1.8 us this took per reply)."""
        if not self._buf and self._failed is None and len(data) >= 8:
            magic, version, flags, length = _unpack_header(data)
            if (len(data) == 8 + length and magic == MAGIC and version == PROTOCOL_VERSION
                    and not flags and length <= self.max_frame_bytes):
                try:
                    return [self._body(data[8:])]
                except EmsException as exc:
                    self._failed = exc
                    raise
        self.feed(data)
        out: list[Any] = []
        while True:
            try:
                body = self.next_body()
            except EmsException:
                if out:
                    return out
                raise
            if body is NOTHING:
                return out
            out.append(body)

    @property
    def failed(self) -> Optional[EmsException]:
        """Why the stream is corrupt (None: it is not)."""
        return self._failed

    def next_body(self) -> Any:
        """The next complete frame's decoded body, or :data:`NOTHING`; unchecked
        (``messages.wire_class`` and ``validate`` check it: the daemon's request path
        builds no message objects)."""
        if self._failed is not None:
            raise self._failed
        try:
            return self._next()
        except EmsException as exc:
            self._failed = exc
            self._buf.clear()
            raise

    def _next(self) -> Any:
        buf = self._buf
        n = len(buf)
        if n < 8:  # HEADER.size
            if buf and not MAGIC.startswith(bytes(buf[:2])):
                raise protocol_error("not an ems frame (bad magic); is this an ems client?")
            return NOTHING
        magic, version, flags, length = _unpack_header(buf)
        if magic != MAGIC or version != PROTOCOL_VERSION or flags or (
                length > self.max_frame_bytes):
            self._bad_header(magic, version, flags, length)
        end = 8 + length
        if n < end:
            return NOTHING
        obj = self._body(bytes(buf[8:end]))  # (bytes: faster)
        if n == end:  # the usual case: one whole frame
            buf.clear()
        else:
            del buf[:end]
        return obj

    def _body(self, raw: bytes) -> Any:
        # (raw=False and strict_map_key=True: msgpack >= 1.0's defaults)
        l5 = self._limits5
        try:
            if l5 is not None:
                return _unpackb(raw, max_array_len=l5[0], max_str_len=l5[1],
                                max_bin_len=l5[2], max_map_len=l5[3], max_ext_len=l5[4])
            return _unpackb(raw, **self._limits) if self._limits else _unpackb(raw)
        except Exception as exc:  # noqa: BLE001 - msgpack raises many kinds for junk
            if _past_a_limit(exc):
                raise DecodeLimitExceeded(f"malformed frame body: {exc}") from None
            raise protocol_error(f"malformed frame body: {type(exc).__name__}: {exc}") from None

    def _bad_header(self, magic: bytes, version: int, flags: int, length: int) -> None:
        if magic != MAGIC:
            raise protocol_error("not an ems frame (bad magic); is this an ems client?")
        if version != PROTOCOL_VERSION:
            raise protocol_error(f"protocol version {version} is not supported (this side "
                                 f"speaks version {PROTOCOL_VERSION}); upgrade the older "
                                 f"of the ems client and ems-server")
        if flags != 0:
            raise protocol_error(f"frame flags must be 0, got {flags:#x}")
        raise protocol_error(f"frame of {length} bytes exceeds the limit of "
                             f"{self.max_frame_bytes}")
