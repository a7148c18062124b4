"""One connection's state machine, for both ends, sans-I/O (h11's rule: everything
that moves the state lives here; the daemon's event loop and the client's session
only move bytes).

Bytes in (``receive``), events out; calls that send return the frame to write. No
socket, no clock, no thread: the drivers own those (``ems.server.daemon``,
``ems.client.session``) and the unit tests drive both ends against each other.

The daemon's side (:class:`ServerConnection`)::

    HELLO --Hello, anonymous / admin: welcome()------------------------> READY
      |  \\--Hello(access_id): challenge(nonce)--> AUTH --Auth: welcome()--^
      |                                            |
      +--Ping: pong() (stays HELLO; a probe)       +--refuse() / fail()--> CLOSED
      +--refuse() / fail() / anything else (EMS_PROTOCOL_ERROR)--------> CLOSED

    READY: every request (its fields checked, positional in the order of its one
           definition in ``messages``) is an event; the driver answers with reply().

The client's side (:class:`ClientConnection`)::

    HELLO (hello() sent) --Challenge: auth frame to send--> AUTH
      |                                                      |
      +--Welcome-------------------------> READY <--Welcome--+
      +--Error / anything else: raised --> CLOSED <----------+

    READY: start(tag) -> rid      a request goes out (its tag: whatever the driver
                                  wakes when the reply comes)
           cancel(rid)            it never went out: forgotten
           give_up(rid)           nobody waits any more: its reply will be LATE
           receive(data)          -> [(tag, reply)]: replies matched by rid;
                                     a late one comes as (LATE, reply) and means what
                                     ``undo_late(reply)`` gives back to the daemon
           close()                -> the tags still waiting (they get the error)

What a late reply means is decided here, once: a reply nobody waits for any more
still granted something the daemon holds for this connection (reservations, pins,
lease space), and ``undo_late`` names the one-way messages that give it back. A reply
to a rid never issued, a rid reused, an ``Error`` with rid 0 (the daemon closes the
connection and says why): the connection is over (``error``).
"""

from __future__ import annotations

import enum
from typing import Any, Hashable, Iterator, Optional

from ems.errors import EmsErrorCode, EmsException
from ems.protocol import messages as m
from ems.protocol.framing import MAX_FRAME_BYTES, FrameDecoder, encode, encode_wire

__all__ = [
    "HANDSHAKE_FRAME_BYTES",
    "LATE",
    "REQUESTS",
    "ClientConnection",
    "Phase",
    "ServerConnection",
    "undo_late",
]

#: No handshake message is bigger: what an unauthenticated peer can make us buffer.
HANDSHAKE_FRAME_BYTES = 4096
#: The tag of a reply nobody waits for any more (see :func:`undo_late`).
LATE: Hashable = "late"
#: What a READY connection may send the daemon.
REQUESTS = frozenset({m.Reserve, m.Commit, m.Abort, m.Acquire, m.Release, m.Exists,
                      m.Stats, m.Ping, m.Lease, m.Put, m.Return})


class Phase(enum.Enum):
    HELLO = "hello"
    AUTH = "auth"
    READY = "ready"
    CLOSED = "closed"


def _bad(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, message)


def undo_late(reply: m.Message) -> list[m.Message]:
    """The one-way messages that give back what a reply nobody waits for granted:
    Granted -> Abort of its NEW tokens, Pinned -> Release, Leased / Stored with a
    lease -> Return of it. Other replies hold nothing (a late Committed or Stored
    means the keys are stored: that stays)."""
    if isinstance(reply, m.Granted):
        tokens = [t for s, t in zip(reply.statuses, reply.tokens)
                  if s == m.GrantStatus.NEW]
        return [m.Abort(tokens=tokens)] if tokens else []
    if isinstance(reply, m.Pinned):
        return [m.Release(tokens=list(reply.tokens))] if reply.tokens else []
    if isinstance(reply, m.Leased) and reply.size:
        return [m.Return(offsets=[reply.offset], sizes=[reply.size])]
    if isinstance(reply, m.Stored) and reply.lease_size:
        return [m.Return(offsets=[reply.lease_offset], sizes=[reply.lease_size])]
    return []


# ---------------------------------------------------------------------- daemon

#: Requests whose last field, ``hashes`` (the engine's block hashes, for KV events),
#: the daemon reads from :attr:`ServerConnection.hashes` instead of as a handler
#: argument (it changes nothing the handler does; the KV-event observer reads it)
HASHES_HELD = frozenset({m.Reserve, m.Put})


class ServerConnection:
    """The daemon's side of one connection (see the module docstring)."""

    __slots__ = ("_decoder", "access_id", "admin", "hashes", "nonce", "phase")

    def __init__(self) -> None:
        #: the ``hashes`` of the Reserve or Put just received (None: none sent), until
        #: the next message: what a handler of one may publish as KV events
        self.hashes: Optional[list[int]] = None
        self.phase = Phase.HELLO
        self._decoder = FrameDecoder(HANDSHAKE_FRAME_BYTES)
        self.access_id: Optional[str] = None  # of the Hello, while AUTH
        self.admin = False
        self.nonce = b""

    @property
    def buffered(self) -> int:
        """Bytes of partial frames held (the daemon bounds their sum)."""
        return self._decoder.buffered

    def receive(self, data: bytes) -> Iterator[tuple[type[m.Message], list[Any]]]:
        """The messages in ``data`` as ``(class, checked field values)``, in order.
        The driver acts on each before the next is taken (a reply moves the phase);
        none after the connection closed. A corrupt stream, a message of the wrong
        phase or not a request: ``EMS_PROTOCOL_ERROR`` (after the good ones)."""
        decoder = self._decoder
        for body in decoder.bodies(data):
            if self.phase is Phase.CLOSED:
                return
            cls = m.wire_class(body)
            values = cls.validate(body[1:])
            phase = self.phase
            if phase is Phase.READY:
                if cls not in REQUESTS:
                    raise _bad(f"{cls.__name__} is not a request")
            elif not ((cls is m.Hello or cls is m.Ping) and phase is Phase.HELLO
                      or cls is m.Auth and phase is Phase.AUTH):
                raise _bad(f"unexpected {cls.__name__} during {phase.value}")
            elif cls is m.Hello:
                self.access_id, self.admin = values[0], values[1]
            if cls in HASHES_HELD:
                self.hashes = values[-1]
                values = values[:-1]
            yield cls, values
        if decoder.failed is not None:  # a corrupt frame after good ones
            raise decoder.failed

    # -- what the daemon sends (each returns the frame)
    def pong(self, rid: int) -> bytes:
        if self.phase is not Phase.HELLO and self.phase is not Phase.READY:
            raise _bad(f"Pong during {self.phase.value}")
        return encode_wire(m.Pong.wire(rid=rid))

    def challenge(self, nonce: bytes) -> bytes:
        """Ask the client of a named Hello to prove its key: HELLO -> AUTH."""
        self._expect(Phase.HELLO, "Challenge")
        if self.access_id is None:
            raise _bad("a Challenge to an anonymous Hello")
        self.nonce, self.phase = nonce, Phase.AUTH
        return encode(m.Challenge(nonce=nonce))

    def welcome(self, welcome: m.Welcome, max_frame_bytes: int = MAX_FRAME_BYTES,
                unpack_limits: Optional[dict[str, int]] = None) -> bytes:
        """Accept the session (HELLO or AUTH -> READY): requests may now be as large
        as ``max_frame_bytes``, decoded within ``unpack_limits``."""
        if self.phase is not Phase.HELLO and self.phase is not Phase.AUTH:
            raise _bad(f"Welcome during {self.phase.value}")
        self.phase, self.nonce = Phase.READY, b""
        self._decoder.max_frame_bytes = min(MAX_FRAME_BYTES, max_frame_bytes)
        self._decoder.unpack_limits = unpack_limits or {}  # (the decoder keeps a copy)
        return encode(welcome)

    def reply(self, wire: list[Any]) -> bytes:
        """A reply to a request (``Cls.wire(...)``)."""
        if self.phase is not Phase.READY:
            raise _bad(f"a reply during {self.phase.value}")
        return encode_wire(wire)

    def refuse(self, code: EmsErrorCode, message: str) -> bytes:
        """The last frame: why the connection ends (rid 0). Any phase -> CLOSED."""
        self.phase = Phase.CLOSED
        return encode(m.Error(rid=0, code=code.value, message=message))

    def closed(self) -> None:
        self.phase = Phase.CLOSED

    def _expect(self, phase: Phase, what: str) -> None:
        if self.phase is not phase:
            raise _bad(f"{what} during {self.phase.value}")


# ---------------------------------------------------------------------- client

class ClientConnection:
    """The client's side of one connection (see the module docstring). Not
    thread-safe: the session calls it under its lock."""

    __slots__ = ("_access_id", "_access_key", "_decoder", "_next_rid", "error",
                 "orphans", "pending", "phase", "welcome")

    def __init__(self, access_id: Optional[str], access_key: Optional[str]) -> None:
        self.phase = Phase.HELLO
        self._access_id = access_id
        self._access_key = access_key
        self._decoder = FrameDecoder()
        self._next_rid = 1
        self.welcome: Optional[m.Welcome] = None
        #: rid -> tag of every request sent and waited for
        self.pending: dict[int, Any] = {}
        #: rids given up on: their replies are LATE
        self.orphans: set[int] = set()
        #: why the connection is over (set once; the driver fails the session)
        self.error: Optional[EmsException] = None

    def hello(self, admin: bool = False) -> bytes:
        """The first frame (anonymous when the access_id is None)."""
        return encode(m.Hello(access_id=self._access_id, admin=admin))

    def handshake(self, data: bytes) -> Optional[bytes | m.Welcome]:
        """Handshake bytes in: the Auth frame to send (a Challenge came), the Welcome
        (now READY), or None (more bytes needed). An Error (the daemon refused) is
        raised as its ``EmsException``; anything else as ``EMS_PROTOCOL_ERROR``."""
        if self.phase is Phase.READY or self.phase is Phase.CLOSED:
            raise _bad(f"handshake data during {self.phase.value}")
        self._decoder.feed(data)
        try:
            msg = self._decoder.next_message()
            if msg is None:
                return None
            if isinstance(msg, m.Error):
                raise msg.exception()
            if isinstance(msg, m.Challenge) and self.phase is Phase.HELLO:
                if self._access_id is None or self._access_key is None:
                    raise _bad("ems-server sent a challenge to an anonymous client")
                self.phase = Phase.AUTH
                return encode(m.Auth(mac=m.auth_mac(self._access_key, msg.nonce,
                                                    self._access_id)))
            if isinstance(msg, m.Welcome):
                self.phase, self.welcome = Phase.READY, msg
                return msg
            raise _bad(f"ems-server sent {type(msg).__name__} during the handshake "
                       f"({self.phase.value})")
        except EmsException:
            self.phase = Phase.CLOSED
            raise

    # -- requests
    def start(self, tag: Any) -> int:
        """A fresh rid for a request about to be sent; its reply goes to ``tag``."""
        if self.phase is not Phase.READY:
            raise _bad(f"a request during {self.phase.value}")
        rid = self._next_rid
        self._next_rid = rid + 1
        self.pending[rid] = tag
        return rid

    def cancel(self, rid: int) -> None:
        """The request never went out: no reply will come."""
        self.pending.pop(rid, None)

    def give_up(self, rid: int) -> None:
        """Nobody waits for ``rid`` any more: its reply (if it comes) is LATE."""
        if self.pending.pop(rid, None) is not None:
            self.orphans.add(rid)

    def receive(self, data: bytes) -> list[tuple[Any, m.Message]]:
        """The replies in ``data``, each with the tag of its request (or :data:`LATE`).
        When the stream says the connection is over (a corrupt frame, an Error with
        rid 0, a reply to no request), :attr:`error` is set and the replies before it
        are returned; nothing is matched after it."""
        out: list[tuple[Any, m.Message]] = []
        if self.error is not None:
            return out
        try:
            for body in self._decoder.bodies(data):
                msg = m.from_wire(body)
                rid = getattr(msg, "rid", 0)
                if rid == 0:
                    if isinstance(msg, m.Error):
                        raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                                           f"ems-server closed the connection: "
                                           f"{msg.exception()}")
                    raise _bad(f"ems-server sent an unsolicited {type(msg).__name__}")
                tag = self.pending.pop(rid, None)
                if tag is not None:
                    out.append((tag, msg))
                elif rid in self.orphans:
                    self.orphans.discard(rid)
                    out.append((LATE, msg))
                else:
                    raise _bad(f"ems-server sent {type(msg).__name__} for request {rid}, "
                               f"which is not waiting for one")
            if self._decoder.failed is not None:
                raise self._decoder.failed
        except EmsException as exc:
            self.error = exc
            self.phase = Phase.CLOSED
        return out

    def close(self) -> list[Any]:
        """The connection is over: the tags still waiting (to get the error)."""
        self.phase = Phase.CLOSED
        tags, self.pending = list(self.pending.values()), {}
        self.orphans.clear()
        return tags
