"""The daemon's listening socket: taking the path, accepting under fd pressure.

Taking the path: one daemon per ``socket_dir`` is the daemon's flock; here, a socket
file that answers is a live daemon (refused), one that does not is stale (replaced),
anything else at the path is not ours (refused). On close the file is removed only if
it is still ours (same inode): a successor may have replaced it.

Accept under fd pressure (EMFILE): the listener stays readable while accept fails, so
polling it again at once spins a core (and, logging each failure, wrote megabytes of
log per second). Instead the daemon closes the oldest connection that never finished
its handshake, stops polling the listener for a backoff (50 ms doubling to 1 s, reset
by the next successful accept) and warns at most once per ``WARN_EVERY_S``
(``ems.server.ratelimit``); the connected clients are served meanwhile::

    LISTENING --accept fails: EMFILE--> PAUSED (listener out of epoll, backoff)
        ^                                  |
        +----- backoff over: poll again ---+
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import time
from typing import Callable, Iterator, Optional

from ems.server.ratelimit import RateLimitedLog

__all__ = ["Listener", "ListenError"]

logger = logging.getLogger("ems.server.daemon")

_PEERCRED = struct.Struct("3i")
#: accept failures that mean "no fd or memory for a new connection now"
_PRESSURE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.05, 1.0
#: connections taken per readable event (the others wait for the next poll)
_ACCEPT_BATCH = 64


class ListenError(Exception):
    """The socket path cannot be taken (the daemon reports it and does not start)."""


class Listener:
    """The listening unix socket at ``path`` and its accept state (see the module
    docstring). ``watch`` / ``unwatch`` put the socket in and out of the loop's epoll."""

    def __init__(self, path: str, mode: int, watch: Callable[[socket.socket], None],
                 unwatch: Callable[[socket.socket], None], log: RateLimitedLog) -> None:
        self.path = path
        self._mode = mode
        self._watch, self._unwatch = watch, unwatch
        self._log = log
        self.sock: Optional[socket.socket] = None
        self._inode = -1
        #: fd pressure: the listener is out of the epoll until then (0: listening)
        self.paused_until = 0.0
        self._backoff_s = _BACKOFF_MIN_S

    def take(self) -> None:
        """Bind ``path`` (refusing a live daemon, replacing a stale socket file)."""
        path = self.path
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise ListenError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                logger.info("ems-server: replacing the stale socket %s", path)
                os.unlink(path)
            else:
                raise ListenError(f"a process is serving {path} already; refusing to start")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~self._mode)
        try:
            listener.bind(path)
        except OSError as exc:
            listener.close()
            raise ListenError(f"cannot bind {path}: {exc.strerror}") from exc
        finally:
            os.umask(old)
        os.chmod(path, self._mode)
        listener.listen(128)
        listener.setblocking(False)
        self.sock = listener
        self._inode = os.stat(path).st_ino
        self._watch(listener)

    def accept(self, make_room: Callable[[], None],
               open_count: int) -> Iterator[tuple[socket.socket, int, int]]:
        """The waiting connections (non-blocking, with the peer's pid and uid), up to a
        batch; on fd pressure ``make_room()`` and a pause."""
        assert self.sock is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _PRESSURE:
                    make_room()
                    self._pause(exc, open_count)
                else:  # a connection that died in the backlog: keep serving
                    logger.debug("ems-server: accept failed: %s", exc)
                return
            self._backoff_s = _BACKOFF_MIN_S
            sock.setblocking(False)
            try:
                pid, uid, _gid = _PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError:
                pid = uid = -1
            yield sock, pid, uid

    def _pause(self, exc: OSError, open_count: int) -> None:
        if self.sock is not None and not self.paused_until:
            self._unwatch(self.sock)
        self.paused_until = time.monotonic() + self._backoff_s
        self._log.warn(f"ems-server: accept failed ({exc.strerror}): not accepting for "
                       f"{self._backoff_s * 1000:.0f} ms; {open_count} connection(s) open")
        self._backoff_s = min(_BACKOFF_MAX_S, self._backoff_s * 2)

    def resume_if_due(self, now: float) -> None:
        """Poll the listener again once the backoff is over."""
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            if self.sock is not None:
                self._watch(self.sock)

    def close(self) -> None:
        """Stop listening; remove the socket file if it is still ours."""
        if self.sock is None:
            return
        self._unwatch(self.sock)  # (a no-op while paused)
        self.sock.close()
        self.sock = None
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass
