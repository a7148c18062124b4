"""The handlers' output side for in-process tests: every reply kept, in order."""

from __future__ import annotations

from ems.server.session import Session


class Replies:
    """An ``ems.server.handlers.Output`` that keeps each reply's wire form."""

    def __init__(self) -> None:
        self.wires: list[list[object]] = []

    def reply(self, session: Session, wire: list[object]) -> None:
        self.wires.append(wire)
