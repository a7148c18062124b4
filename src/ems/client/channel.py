"""The socket under a session: connect, handshake, send by a deadline, receive; and
the one place where socket errors become ``EmsException``.

Nothing above this module sees an ``OSError`` or ``socket.timeout``: a refused
connect is ``EMS_RECOVERD_ERROR`` (the daemon is not there *yet*: ``Ems.init`` may
retry), a lost connection ``EMS_IO_ERROR``, a deadline :class:`Timeout`
(``EMS_IO_TIMEOUT``; the session tells "no byte went out" from "part of a frame did",
which breaks the stream).

Deadlines cover sending too. The socket is non-blocking: a frame is written with
``send`` + ``poll(POLLOUT)`` until the request's deadline (a frozen daemon stops
reading, its socket buffer fills, and a blocking ``sendall`` waited for the whole
freeze: a load of a few thousand keys with ``timeout=500`` returned after seconds,
~30 s for a daemon that never woke).
"""

from __future__ import annotations

import math
import mmap
import os
import select
import socket
import time
from typing import Optional

from ems.client.segment import Segment
from ems.errors import EmsErrorCode, EmsException
from ems.protocol import encode
from ems.protocol import messages as m
from ems.protocol.connection import ClientConnection
from ems.protocol.framing import FrameDecoder

__all__ = ["Channel", "Timeout", "io_error", "not_yet", "probe"]

_monotonic = time.monotonic
#: Bytes asked of one recv (a reply is small; CPython allocates the whole size).
_RECV_BYTES = 1 << 16


class Timeout(EmsException):
    """A deadline passed (``EMS_IO_TIMEOUT``). ``partial``: part of a frame went out,
    so the stream is corrupt and the connection must go."""

    def __init__(self, message: str, partial: bool = False) -> None:
        super().__init__(EmsErrorCode.EMS_IO_TIMEOUT, message)
        self.partial = partial


def io_error(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_IO_ERROR, message)


def not_yet(message: str) -> EmsException:
    """The daemon cannot be reached *yet*: a later ``Ems.init`` may succeed."""
    return EmsException(EmsErrorCode.EMS_RECOVERD_ERROR, message)


def bad_reply(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, f"ems-server sent {message}")


def probe(path: str, timeout_s: float) -> bool:
    """Whether a daemon answers on ``path`` within ``timeout_s`` (a Ping before any
    handshake, which the daemon answers in its HELLO phase). Never raises."""
    deadline = _monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(timeout_s, 0.001))
        sock.connect(path)
        sock.sendall(encode(m.Ping(rid=1)))
        decoder = FrameDecoder(4096)
        while True:
            msg = decoder.next_message()
            if msg is not None:
                return isinstance(msg, m.Pong)
            remaining = deadline - _monotonic()
            if remaining <= 0:
                return False
            sock.settimeout(remaining)
            data = sock.recv(4096)
            if not data:
                return False
            decoder.feed(data)
    except (OSError, EmsException):
        return False
    finally:
        sock.close()


class Channel:
    """One connected unix socket (non-blocking once open)."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self._read_poll = select.poll()
        self._read_poll.register(sock.fileno(), select.POLLIN)
        self._write_poll = select.poll()
        self._write_poll.register(sock.fileno(), select.POLLOUT)
        self.fileno = sock.fileno()
        #: ``poll_in(timeout_ms)``: the poll for readability (bytes or the end: a
        #: non-empty list); 0 polls without waiting (the spin loop)
        self.poll_in = self._read_poll.poll

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str, proto: ClientConnection, timeout_s: float, admin: bool = False
             ) -> tuple["Channel", m.Welcome, Optional[Segment]]:
        """Connect, authenticate and map the tenant's memory, all within ``timeout_s``."""
        deadline = _monotonic() + timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        fds: list[int] = []
        try:
            sock.settimeout(max(timeout_s, 0.001))
            try:
                sock.connect(path)
            except FileNotFoundError:
                raise not_yet(f"no ems-server socket at {path} (start ems-server, or set "
                              f"EMS_SOCKET_DIR)") from None
            except ConnectionRefusedError:
                raise not_yet(f"nothing listens on {path} (a stale socket: ems-server is "
                              f"not running)") from None
            except socket.timeout:
                raise not_yet(f"ems-server at {path} did not accept within "
                              f"{timeout_s:.1f} s") from None
            except OSError as exc:
                raise not_yet(f"cannot connect to {path}: {exc}") from exc
            sock.sendall(proto.hello(admin))
            while True:
                step = cls._handshake_step(sock, proto, fds, deadline, path, timeout_s)
                if isinstance(step, m.Welcome):
                    break
                sock.sendall(step)  # the Auth frame
            welcome = step
            segment = None
            if welcome.segment_size:
                if len(fds) != 1:
                    raise bad_reply(f"{len(fds)} file descriptors with Welcome, not 1")
                segment = _map(fds[0], welcome.segment_id, welcome.segment_size)
            elif fds:
                raise bad_reply("file descriptors with an admin Welcome")
            sock.setblocking(False)  # every wait from here on is a poll to a deadline
            return cls(sock, path), welcome, segment
        except EmsException:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise io_error(f"ems-server at {path} broke the handshake: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _handshake_step(sock: socket.socket, proto: ClientConnection, fds: list[int],
                        deadline: float, path: str, timeout_s: float) -> bytes | m.Welcome:
        data = b""
        while True:
            step = proto.handshake(data)
            if step is not None:
                return step
            remaining = deadline - _monotonic()
            if remaining <= 0:
                raise not_yet(f"ems-server at {path} did not answer within "
                              f"{timeout_s:.1f} s")
            sock.settimeout(remaining)
            try:
                data, got, flags, _ = socket.recv_fds(sock, 1 << 16, 4)
            except socket.timeout:
                data = b""
                continue
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise bad_reply("more file descriptors than expected")
            if not data:
                raise io_error(f"ems-server at {path} closed the connection during the "
                               f"handshake")

    # ------------------------------------------------------------ I/O
    def send(self, data: bytes, deadline: float) -> None:
        """Write one whole frame by ``deadline`` (a monotonic time). Raises
        :class:`Timeout` (``partial`` when some of it went out) or ``EMS_IO_ERROR``."""
        view, sent, total = memoryview(data), 0, len(data)
        send, wait = self.sock.send, self._write_poll.poll
        while True:
            try:
                sent += send(view[sent:] if sent else view)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise io_error(f"lost the connection to ems-server: {exc}") from exc
            if sent == total:
                return
            remaining = deadline - _monotonic()
            if remaining > 0:  # wait for room (or the deadline), then try again
                wait(math.ceil(remaining * 1000))
                continue
            if sent:
                raise Timeout(f"a send to ems-server ran out of time after {sent} of "
                              f"{total} bytes; the connection is replaced", partial=True)
            raise Timeout("ems-server does not read its socket")

    def recv(self) -> Optional[bytes]:
        """Bytes that arrived (None: none after all, a false positive of poll); the
        daemon closing the connection is ``EMS_IO_ERROR``."""
        try:
            data = self.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise io_error(f"lost the connection to ems-server: {exc}") from exc
        if not data:
            raise io_error("ems-server closed the connection")
        return data

    def shutdown(self) -> None:
        """Wake whoever reads or polls (both directions end); the fd stays open."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def _map(fd: int, segment_id: int, size: int) -> Segment:
    try:
        st = os.fstat(fd)
        if st.st_size < size:
            raise bad_reply(f"a segment of {st.st_size} bytes announced as {size}")
        # MAP_POPULATE: fill the page tables now (~20-50 ms per 512 MiB of pages the
        # daemon already has) instead of one minor fault per 4 KiB page on this
        # process's first pass over the pool, which caps its first saves at
        # ~2.5-3 GB/s against ~9-10.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise io_error(f"cannot map the tenant's memory ({size} bytes): {exc}") from exc
    return Segment(segment_id, mm)
