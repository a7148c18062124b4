"""One client connection's state in the daemon: a :class:`Session`.

Everything the daemon keeps per connection lives here, in one named type: the socket
and its output queue (driven by ``ems.server.daemon``), the protocol state machine
(``ems.protocol.connection.ServerConnection``), who it is (tenant, admin, key id), and
what it holds in its tenant's pool (the count of its pins, its open reservations).
The pool core keeps the pins, reservations and lease themselves, owned by the
session's ``id``; the session keeps only what the daemon decides by (the pin limit,
what a Commit of a reservation must do).

A session's life::

    accept --> HELLO --[Hello / Auth ok]--> READY --[EOF, error, kicked]--> CLOSED
                 |                                                            ^
                 +--[refused, handshake timeout]------------------------------+

Only a READY session is :attr:`~Session.ready`: a reply computed after a tier's round
trip goes to a session that is still ready, and still of the same tenant, or nowhere.
"""

from __future__ import annotations

import collections
import dataclasses
import socket
from typing import NamedTuple, Optional

from ems.protocol.connection import Phase, ServerConnection
from ems.server.tenants import Tenant

__all__ = ["Reservation", "Session"]


class Reservation(NamedTuple):
    """A key this session reserved (NEW) and has not committed or aborted yet: what a
    Commit of its token stores, and where (``write_rcache`` False: the shared tier only,
    no local copy). (A named tuple: a save makes one per key while a tier is on, and a
    frozen dataclass cost three times as much.)"""

    key: str
    offset: int
    size: int
    write_rcache: bool
    #: the engine's block hash of the key (KV events), if the save carried one
    hash: Optional[int] = None
    #: the save's ``write_out`` (False: the tiers do not write it out)
    write_out: bool = True


@dataclasses.dataclass(eq=False)
class Session:
    """A client connection (see the module docstring)."""

    id: int
    sock: socket.socket
    pid: int
    uid: int
    opened_at: float
    proto: ServerConnection = dataclasses.field(default_factory=ServerConnection)
    tenant: Optional[Tenant] = None
    admin: bool = False
    key_id: Optional[str] = None  # which of the tenant's keys opened this session
    out: collections.deque = dataclasses.field(default_factory=collections.deque)
    out_bytes: int = 0
    writing: bool = False
    pins: int = 0  # pins this session holds (bounded by max_pins_per_connection)
    buffered: int = 0  # bytes of its partial frames counted in the daemon's total
    #: token -> its reservation, kept only where a tier acts on commits
    reservations: dict[int, Reservation] = dataclasses.field(default_factory=dict)

    @property
    def phase(self) -> Phase:
        return self.proto.phase

    @property
    def ready(self) -> bool:
        """Open and past its handshake (a late reply may still go to it)."""
        return self.proto.phase is Phase.READY

    def serves(self, tenant: Tenant) -> bool:
        """Ready, and a session of ``tenant`` (a late reply's check)."""
        return self.tenant is tenant and self.proto.phase is Phase.READY

    def __str__(self) -> str:
        who = self.tenant.name if self.tenant else ("admin" if self.admin else "-")
        return f"connection {self.id} (pid {self.pid}, uid {self.uid}, tenant {who})"
