"""The handlers' output side for in-process tests: every reply kept, in order."""

from __future__ import annotations

import msgpack

from ems.server.session import Session


class Replies:
    """An ``ems.server.handlers.Output`` that keeps each reply's wire form as a client
    decodes it (through msgpack, as the daemon sends it: a handler may answer with
    tuples and enum members where the client reads lists and ints)."""

    def __init__(self) -> None:
        self.wires: list[list[object]] = []

    def reply(self, session: Session, wire: list[object]) -> None:
        self.wires.append(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True)))
