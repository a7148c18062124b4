"""A thin RESP2 client side: commands out, replies in, values straight into given memory.

The stock clients build a Python ``bytes`` per value (and copy it again into the
caller's buffer); on a 2-vCPU VM that capped a pipelined GET at 0.6-0.9 GB/s, while
reading each bulk value with ``recv_into`` into memory the caller owns ran 2.3-3.0
GB/s (``ems bench --systems cluster`` measures this path beside valkey-py:
docs/benchmarks.md). So:

* :func:`command` encodes one command (small arguments) as ``bytes``; a value to
  store is not encoded: :func:`set_parts` gives the buffers of a SET (the command's
  head, the value's own memoryviews, the trailing CRLF) for ``sendmsg``, which
  gathers them without a copy (:func:`send_parts`).
* :class:`Reader` reads replies from a socket in timeout mode; with
  :attr:`Reader.deadline` set, every ``recv`` waits at most what is left of it (see
  "Deadlines" below).
  Simple strings, errors, integers and arrays come back as Python objects (they are
  small); a bulk string is either returned as ``bytes`` (:meth:`Reader.reply`, for
  control commands) or handed to the caller, who gets its length first and then
  reads it with :meth:`Reader.read_into` into its own memoryview (what is already
  buffered is copied from the read buffer; the rest goes from the socket straight
  into that memory) or skips it (:meth:`Reader.skip`).
* Between large values the caller narrows the reads into the buffer
  (:attr:`Reader.fill_limit`): a full-size ``recv`` there takes the next reply's line
  *and* up to 64 KiB of its value, which then costs a second, user-space copy into
  the caller's memory (a quarter of the bytes of a 256 KiB value); a narrow one takes
  the line and the value's header and leaves the value in the socket for
  ``recv_into`` its target.

Deadlines: a socket timeout bounds one ``recv``, not a reply: a value that trickles in
(a byte a second) would keep a reply going past any timeout that is armed once per
call. So each ``recv`` (and each ``sendmsg`` of :func:`send_parts`) first checks the
clock against the deadline (``socket.timeout`` once it has passed) and, at most once
per :data:`REARM_S`, sets the socket's timeout to what is left: ``settimeout`` costs
an ``ioctl``, once per reply was 8% of a daemon's samples loading 256 KiB values
(py-spy), so a wait may overrun the deadline by at most ``REARM_S``.

Errors: an OSError or ``socket.timeout`` from the socket propagates (the caller owns
the connection and drops it); a reply that is not RESP raises :class:`RespError`.
An error reply is a :class:`ErrorReply` value, not an exception (MOVED/ASK are
answers to act on).
"""

from __future__ import annotations

import socket
import time
from typing import Any, Iterable, Optional, Sequence, Union

__all__ = ["NARROW_FILL", "REARM_S", "Deadline", "ErrorReply", "Reader", "RespError",
           "command", "send_parts", "set_parts"]

Buffer = Union[bytes, bytearray, memoryview]

#: Read buffer: large enough that a pipeline's small replies come in one recv, small
#: enough that a value's bulk goes mostly straight into the caller's memory.
_BUFFER = 64 << 10
#: :attr:`Reader.fill_limit` between large values: the CRLF, the next reply's line
#: ("$<len>\r\n") and the 32-byte value header fit, little of the value itself.
NARROW_FILL = 64
#: At most this many iovecs per sendmsg (Linux IOV_MAX is 1024).
_IOV_MAX = 512
#: Longest time between two ``settimeout`` calls of a socket with a deadline: a wait
#: overruns the deadline by at most this much (module docstring, "Deadlines").
REARM_S = 0.001


class Deadline:
    """The deadline of one socket's waits (``time.monotonic()``; None: the socket's
    own timeout alone). :meth:`arm` before each blocking call."""

    __slots__ = ("sock", "at", "_armed", "progressed")

    def __init__(self, sock: socket.socket, at: Optional[float] = None) -> None:
        self.sock = sock
        self.at = at
        self._armed = -1.0  # when settimeout was last called for ``at``
        #: when the last wait began (the one before it ended): a socket that
        #: makes progress calls :meth:`arm` often
        self.progressed = 0.0

    def set(self, at: Optional[float]) -> None:
        """A new deadline (the next :meth:`arm` sets the socket's timeout)."""
        self.at = at
        self._armed = -1.0

    def arm(self) -> None:
        """Raise ``socket.timeout`` when the deadline has passed; else make sure the
        next wait ends by it (+ at most :data:`REARM_S`)."""
        at = self.at
        if at is None:
            return
        now = self.progressed = time.monotonic()
        if now >= at:
            raise socket.timeout("past the request's deadline")
        if now - self._armed > REARM_S:
            self.sock.settimeout(at - now)
            self._armed = now


class RespError(Exception):
    """The peer sent something that is not RESP2 (the connection is unusable)."""


class ErrorReply(str):
    """An error reply (``-ERR ...``, ``-MOVED 3999 127.0.0.1:7001``)."""


def command(*args: Union[str, bytes, int]) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, int):
            arg = str(arg).encode()
        elif isinstance(arg, str):
            arg = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def set_parts(key: bytes, value: Sequence[Buffer], extra: Sequence[bytes] = ()) -> list[Buffer]:
    """The buffers of ``SET key <value parts concatenated> [extra...]``; the value parts
    are passed through as they are (no copy)."""
    size = sum(len(v) for v in value)
    head = [b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(extra), len(key), key,
                                                          size)]
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(e), e) for e in extra)
    return [*head, *value, tail]


def send_parts(sock: socket.socket, parts: Iterable[Buffer],
               deadline: Optional[Deadline] = None) -> int:
    """Send every buffer of ``parts`` in order with ``sendmsg`` (gathered, not joined);
    handles short sends; each ``sendmsg`` waits within ``deadline``. Returns the bytes
    sent."""
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    total = 0
    i = 0
    while i < len(pending):
        if deadline is not None:
            deadline.arm()
        n = sock.sendmsg(pending[i:i + _IOV_MAX])
        total += n
        while n and i < len(pending):
            size = len(pending[i])
            if n >= size:
                n -= size
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0
    return total


class Reader:
    """Replies of one connection (see the module docstring)."""

    def __init__(self, sock: socket.socket, size: int = _BUFFER,
                 deadline: Optional[float] = None) -> None:
        self.sock = sock
        #: every recv waits within it (:meth:`Deadline.set` moves it)
        self.deadline = Deadline(sock, deadline)
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        #: most bytes one read into the buffer takes (the caller narrows it to
        #: NARROW_FILL around large values; the module docstring says why)
        self.fill_limit = size

    # ------------------------------------------------------------ low level
    def _fill(self, limit: int = 0) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # compact what is left to the front
            n = self._end - self._start
            self._view[:n] = self._view[self._start:self._end]
            self._start, self._end = 0, n
        end = min(len(self._buf), self._end + (limit or self.fill_limit))
        self.deadline.arm()
        n = self.sock.recv_into(self._view[self._end:end])
        if n == 0:
            raise ConnectionResetError("the Valkey node closed the connection")
        self._end += n

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf) - 2:
                raise RespError("a reply line longer than the read buffer")
            self._fill()

    def read_into(self, target: memoryview) -> None:
        """The next ``len(target)`` bytes of the stream into ``target`` (buffered bytes
        first, then ``recv_into`` the rest straight into it)."""
        n = len(target)
        have = min(n, self._end - self._start)
        if have:
            target[:have] = self._view[self._start:self._start + have]
            self._start += have
        recv_into = self.sock.recv_into
        arm = self.deadline.arm
        while have < n:
            arm()  # a value that trickles in is cut off at the deadline
            got = recv_into(target[have:])
            if got == 0:
                raise ConnectionResetError("the Valkey node closed the connection")
            have += got

    def skip(self, n: int) -> None:
        """Drop the next ``n`` bytes of the stream."""
        while n > 0:
            if self._start == self._end:
                self._fill(len(self._buf))  # bytes to drop: as many per recv as fit
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    def crlf(self) -> None:
        """The CRLF after a bulk string's bytes."""
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start:self._start + 2] != b"\r\n":
            raise RespError("a bulk string not followed by CRLF")
        self._start += 2

    # ------------------------------------------------------------ replies
    def head(self) -> tuple[int, Any]:
        """The start of the next reply: ``(length, None)`` for a bulk string whose
        ``length`` bytes (then CRLF) follow (-1: nil), ``(-2, value)`` for any other
        reply, read whole."""
        line = self._line()
        if line[:1] == b"$":
            return _int(line[1:]), None
        return -2, self._rest(line, 0)

    def reply(self) -> Any:
        """The next reply, read whole (bulk strings as ``bytes``)."""
        return self._rest(self._line(), 0)

    def _rest(self, line: bytes, depth: int) -> Any:
        kind, body = line[:1], line[1:]
        if kind == b"+":
            return body.decode()
        if kind == b"-":
            return ErrorReply(body.decode(errors="replace"))
        if kind == b":":
            return _int(body)
        if kind == b"$":
            n = _int(body)
            if n < 0:
                return None
            data = bytearray(n)
            self.read_into(memoryview(data))
            self.crlf()
            return bytes(data)
        if kind == b"*":
            n = _int(body)
            if n < 0:
                return None
            if depth > 8:
                raise RespError("arrays nested deeper than 8")
            return [self._rest(self._line(), depth + 1) for _ in range(n)]
        raise RespError(f"not a RESP2 reply: {line[:40]!r}")


def _int(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise RespError(f"not a RESP integer: {text[:40]!r}") from None
