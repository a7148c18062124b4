"""The connection's state machine (``ems.protocol.connection``), both ends driven
against each other with no socket; and the one definition of each message's fields,
pinned (the wire format changes only on purpose, with PROTOCOL_VERSION)."""

from __future__ import annotations

import dataclasses
import inspect

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_protocol import MESSAGE_STRATEGIES

from ems.errors import EmsErrorCode, EmsException
from ems.pool import core
from ems.protocol import PROTOCOL_VERSION, encode, encode_wire, report
from ems.protocol import messages as m
from ems.protocol.connection import (
    LATE,
    REQUESTS,
    ClientConnection,
    Phase,
    ServerConnection,
    undo_late,
)
from ems.server import handlers

#: Every message's wire code and field order. Changing a row changes the protocol:
#: bump PROTOCOL_VERSION with it (this table says which version it describes). An
#: optional field added at the end (a default, left off by older senders: Reserve's
#: and Put's ``hashes``, ``write_out``, Reserve's ``budget_ms``) keeps the version: older
#: clients still work.
WIRE = {
    "version": 5,
    m.Hello: (1, ("access_id", "admin")),
    m.Challenge: (2, ("nonce",)),
    m.Auth: (3, ("mac",)),
    m.Welcome: (4, ("tenant", "segment_id", "segment_size", "reservation_ttl_s", "server",
                    "max_keys", "align", "lease_size")),
    m.Reserve: (10, ("rid", "keys", "sizes", "write_rcache", "hashes", "write_out",
                     "budget_ms")),
    m.Commit: (11, ("rid", "tokens", "budget_ms")),
    m.Abort: (12, ("tokens",)),
    m.Acquire: (13, ("rid", "keys", "sizes", "local_only", "budget_ms")),
    m.Release: (14, ("tokens",)),
    m.Exists: (15, ("rid", "keys", "sizes", "local_only", "budget_ms")),
    m.Stats: (16, ("rid", "all_tenants")),
    m.Ping: (17, ("rid",)),
    m.Lease: (18, ("rid",)),
    m.Put: (19, ("rid", "keys", "offsets", "sizes", "want_lease", "write_rcache",
                 "budget_ms", "hashes", "write_out")),
    m.Return: (20, ("offsets", "sizes")),
    m.Granted: (30, ("rid", "statuses", "tokens", "offsets", "sizes")),
    m.Committed: (31, ("rid", "ok")),
    m.Pinned: (32, ("rid", "tokens", "offsets", "sizes")),
    m.Count: (33, ("rid", "n")),
    m.StatsReply: (34, ("rid", "stats")),
    m.Pong: (35, ("rid",)),
    m.Error: (36, ("rid", "code", "message")),
    m.Leased: (37, ("rid", "offset", "size")),
    m.Stored: (38, ("rid", "ok", "lease_offset", "lease_size")),
}


def test_the_wire_format_is_pinned():
    assert WIRE["version"] == PROTOCOL_VERSION
    assert set(m.MESSAGES.values()) == {k for k in WIRE if k != "version"}
    for cls in m.MESSAGES.values():
        code, names = WIRE[cls]
        assert (cls.TYPE, cls._NAMES) == (code, names), cls.__name__


def test_wire_builders_take_fields_by_name_in_the_one_order():
    for cls in m.MESSAGES.values():
        params = inspect.signature(cls.wire).parameters
        assert tuple(params) == cls._NAMES, cls.__name__
        assert all(p.kind is p.KEYWORD_ONLY for p in params.values()), cls.__name__
    put = m.Put(rid=3, keys=["a"], offsets=[64], sizes=[10], want_lease=True)
    assert m.Put.wire(rid=3, keys=["a"], offsets=[64], sizes=[10], want_lease=True) == \
        put.to_wire()
    with pytest.raises(TypeError):
        m.Ping.wire(1)  # positional: refused


def test_the_daemons_handlers_take_each_message_by_its_field_names():
    """The daemon's request handlers name their parameters after the fields of their
    message, in its order: a field added or moved in ``messages`` without the handler
    following fails here, not on the wire."""
    assert set(handlers._HANDLERS) <= REQUESTS
    for cls, handler in handlers._HANDLERS.items():
        params = list(inspect.signature(handler).parameters)
        assert params[:3] == ["self", "session", "pool"], handler.__name__
        assert tuple(params[3:]) == cls._NAMES, (cls.__name__, params)


def test_the_hashes_of_a_reserve_or_put_reach_the_handler():
    """``hashes`` (KV events) is a trailing option of Reserve and Put (before
    ``write_out``); a sender without it (an older client) leaves None, and one hash
    per key is the rule."""
    server = ServerConnection()
    server.phase = Phase.READY
    with_hashes = m.Reserve.wire(rid=1, keys=["a", "b"], sizes=[8, 8], hashes=[1, 2**64 - 1])
    (cls, values), = server.receive(encode_wire(with_hashes))
    assert cls is m.Reserve and values == [1, ["a", "b"], [8, 8], True, [1, 2**64 - 1], True,
                                           0]
    old = m.Put.wire(rid=2, keys=["a"], offsets=[0], sizes=[8], want_lease=False)[:-4]
    (cls, values), = server.receive(encode_wire(old))  # (the four options off)
    assert cls is m.Put and values == [2, ["a"], [0], [8], False, True, 0, None, True]
    with pytest.raises(EmsException):  # one hash per key
        list(server.receive(encode_wire(
            m.Put.wire(rid=3, keys=["a"], offsets=[0], sizes=[8], want_lease=False,
                       hashes=[1, 2]))))


def test_the_shared_vocabulary_matches_the_pool():
    assert {s.name: s.value for s in m.GrantStatus} == \
        {s.name: s.value for s in core.GrantStatus}
    assert [(f.name, f.default) for f in dataclasses.fields(report.PoolStatistics)] == \
        [(f.name, f.default) for f in dataclasses.fields(core.PoolStatistics)]


def test_pool_statistics_rows_are_checked():
    row = dataclasses.asdict(core.PoolStatistics(1, 2, 3, 4, 5, 6, 7, 8, 9))
    row["tiers"] = {"cluster": {}}  # the report's own keys are ignored
    assert report.pool_statistics(row) == report.PoolStatistics(1, 2, 3, 4, 5, 6, 7, 8, 9)
    for bad in ({**row, "hits": "6"}, {**row, "hits": -1}, {k: v for k, v in row.items()
                                                            if k != "objects"}, [row]):
        with pytest.raises(EmsException) as err:
            report.pool_statistics(bad)
        assert err.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR


# ---------------------------------------------------------------- both ends together

def _welcome(**kw) -> m.Welcome:
    fields = dict(tenant="t", segment_id=1, segment_size=1 << 20, reservation_ttl_s=60.0,
                  server="test", max_keys=4096, align=64, lease_size=16384)
    fields.update(kw)
    return m.Welcome(**fields)


def _events(server: ServerConnection, data: bytes) -> list:
    return list(server.receive(data))


def _ready_pair() -> tuple[ClientConnection, ServerConnection]:
    client, server = ClientConnection(None, None), ServerConnection()
    assert _events(server, client.hello()) == [(m.Hello, [None, False])]
    welcome = client.handshake(server.welcome(_welcome()))
    assert isinstance(welcome, m.Welcome) and client.phase is Phase.READY
    assert server.phase is Phase.READY
    return client, server


def test_an_anonymous_handshake():
    client, server = _ready_pair()
    assert client.welcome.align == 64 and client.welcome.lease_size == 16384


def test_a_named_handshake_proves_the_key():
    client, server = ClientConnection("team-a", "k" * 32), ServerConnection()
    assert _events(server, client.hello()) == [(m.Hello, ["team-a", False])]
    assert server.access_id == "team-a"
    auth = client.handshake(server.challenge(b"n" * 32))
    assert isinstance(auth, bytes) and server.phase is Phase.AUTH
    [(cls, values)] = _events(server, auth)
    assert cls is m.Auth and values == [m.auth_mac("k" * 32, b"n" * 32, "team-a")]
    assert isinstance(client.handshake(server.welcome(_welcome())), m.Welcome)


def test_a_refusal_reaches_the_client_as_its_error():
    client, server = ClientConnection(None, None), ServerConnection()
    _events(server, client.hello())
    frame = server.refuse(EmsErrorCode.EMS_AUTH_FAILED, "anonymous access is disabled")
    assert server.phase is Phase.CLOSED
    with pytest.raises(EmsException) as err:
        client.handshake(frame)
    assert err.value.status_code() is EmsErrorCode.EMS_AUTH_FAILED
    assert client.phase is Phase.CLOSED


def test_a_bytewise_handshake():
    client, server = ClientConnection(None, None), ServerConnection()
    _events(server, client.hello())
    frame = server.welcome(_welcome())
    steps = [client.handshake(frame[i:i + 1]) for i in range(len(frame))]
    assert steps[:-1] == [None] * (len(frame) - 1) and isinstance(steps[-1], m.Welcome)


@pytest.mark.parametrize("phase, msg", [
    ("hello", m.Auth(mac=b"x")),
    ("hello", m.Reserve(rid=1, keys=["a"], sizes=[1])),
    ("auth", m.Hello(access_id="x", admin=False)),
    ("auth", m.Ping(rid=1)),
    ("ready", m.Hello(access_id=None, admin=False)),
    ("ready", m.Pong(rid=1)),  # a reply is not a request
])
def test_the_daemon_refuses_a_message_of_the_wrong_phase(phase, msg):
    server = ServerConnection()
    if phase != "hello":
        _events(server, encode(m.Hello(access_id="x" if phase == "auth" else None,
                                       admin=False)))
        if phase == "auth":
            server.challenge(b"n" * 32)
        else:
            server.welcome(_welcome())
    with pytest.raises(EmsException) as err:
        _events(server, encode(msg))
    assert err.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR


def test_a_probe_before_the_handshake_stays_in_hello():
    server = ServerConnection()
    assert _events(server, encode(m.Ping(rid=9))) == [(m.Ping, [9])]
    assert server.pong(9) == encode(m.Pong(rid=9)) and server.phase is Phase.HELLO


def test_the_handshake_frame_limit_is_lifted_only_when_ready():
    server = ServerConnection()
    big = encode(m.Hello(access_id="x" * 5000, admin=False))
    with pytest.raises(EmsException, match="exceeds the limit"):
        _events(server, big)
    client, server = _ready_pair()
    rid = client.start("t")
    assert len(_events(server, encode(m.Exists(rid=rid, keys=["x" * 5000], sizes=None)))) == 1


def test_replies_are_matched_by_rid_in_any_order():
    client, server = _ready_pair()
    a, b = client.start("a"), client.start("b")
    reqs = _events(server, encode(m.Ping(rid=a)) + encode(m.Lease(rid=b)))
    assert [c for c, _ in reqs] == [m.Ping, m.Lease]
    data = server.reply(m.Leased.wire(rid=b, offset=0, size=0)) + server.pong(a)
    assert client.receive(data) == [("b", m.Leased(rid=b, offset=0, size=0)),
                                    ("a", m.Pong(rid=a))]
    assert client.pending == {} and client.error is None


@pytest.mark.parametrize("reply, undo", [
    (m.Granted(rid=1, statuses=[0, 1, 0], tokens=[7, 0, 9], offsets=[0, 0, 64],
               sizes=[8, 0, 8]), [m.Abort(tokens=[7, 9])]),
    (m.Granted(rid=1, statuses=[1], tokens=[0], offsets=[0], sizes=[0]), []),
    (m.Pinned(rid=1, tokens=[4, 5], offsets=[0, 64], sizes=[8, 8]),
     [m.Release(tokens=[4, 5])]),
    (m.Leased(rid=1, offset=128, size=4096), [m.Return(offsets=[128], sizes=[4096])]),
    (m.Leased(rid=1, offset=0, size=0), []),
    (m.Stored(rid=1, ok=[True], lease_offset=64, lease_size=512),
     [m.Return(offsets=[64], sizes=[512])]),
    (m.Committed(rid=1, ok=[True]), []),
    (m.Count(rid=1, n=3), []),
])
def test_a_late_reply_is_undone(reply, undo):
    client, server = _ready_pair()
    rid = client.start("waiter")
    assert rid == 1
    client.give_up(rid)
    assert client.receive(server.reply(reply.to_wire())) == [(LATE, reply)]
    assert undo_late(reply) == undo
    assert client.orphans == set() and client.error is None


def test_a_cancelled_request_was_never_sent():
    client, server = _ready_pair()
    rid = client.start("x")
    client.cancel(rid)
    client.receive(server.pong(rid))  # a reply to it is not one to any request
    assert client.error is not None
    assert client.error.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR


def test_the_daemon_closing_says_why_after_the_replies_before_it():
    client, server = _ready_pair()
    rid = client.start("x")
    data = server.pong(rid) + server.refuse(EmsErrorCode.EMS_IO_ERROR, "too slow")
    assert client.receive(data) == [("x", m.Pong(rid=rid))]
    assert client.error.status_code() is EmsErrorCode.EMS_IO_ERROR
    assert "too slow" in client.error.message()
    assert client.receive(encode(m.Pong(rid=5))) == []  # nothing after the end


def test_a_corrupt_frame_after_good_ones():
    client, server = _ready_pair()
    a, _ = client.start("a"), client.start("b")
    data = server.pong(a) + b"EM\x05\x00\x00\x00\x00\x02\xc1\xc1"
    assert client.receive(data) == [("a", m.Pong(rid=a))]
    assert client.error.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR
    assert client.close() == ["b"] and client.phase is Phase.CLOSED


def test_a_request_before_ready_is_refused():
    with pytest.raises(EmsException):
        ClientConnection(None, None).start("x")


def test_a_reply_needs_a_ready_connection():
    server = ServerConnection()
    with pytest.raises(EmsException):
        server.reply(m.Pong.wire(rid=1))
    with pytest.raises(EmsException):
        server.challenge(b"n")  # no named Hello came
    assert encode_wire(m.Pong.wire(rid=1)) == encode(m.Pong(rid=1))


_any_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2, (1 << 64) + 1) | st.floats(-1, 2)
    | st.text(max_size=3) | st.binary(max_size=3),
    lambda inner: st.lists(inner, max_size=3), max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(cls=st.sampled_from(sorted(m.MESSAGES.values(), key=lambda c: c.TYPE)),
       values=st.lists(_any_value, max_size=9))
def test_the_generated_validators_agree_with_the_reference(cls, values):
    """``validate`` (generated, checks written out) says exactly what ``validate_slow``
    (each field's own check function) says, on any decoded values."""
    def outcome(fn):
        try:
            return ("ok", fn(list(values)))
        except EmsException as exc:
            return ("error", exc.status_code(), exc.message())
    assert outcome(cls.validate) == outcome(cls.validate_slow)


@settings(max_examples=300, deadline=None)
@given(msg=st.one_of(list(MESSAGE_STRATEGIES.values())), cut=st.integers(0, 3))
def test_the_generated_validators_agree_on_real_messages(msg, cut):
    """Well-formed messages (and ones with trailing fields left off) pass both."""
    values = msg.to_wire()[1:]
    values = values[:len(values) - cut] if cut else values
    outcomes = []
    for fn in (type(msg).validate, type(msg).validate_slow):
        try:
            outcomes.append(("ok", fn(list(values))))
        except EmsException as exc:
            outcomes.append(("error", exc.message()))
    assert outcomes[0] == outcomes[1]
    if not cut:
        assert outcomes[0] == ("ok", values)


class ClientConnectionMachine(RuleBasedStateMachine):
    """The client's rid bookkeeping against a model: every reply goes to its request's
    tag exactly once, in whatever order the daemon answers; a reply to a request given
    up on comes back LATE (once); nothing is lost or delivered twice."""

    def __init__(self) -> None:
        super().__init__()
        self.client, self.server = _ready_pair()
        self.sent: dict[int, str] = {}  # rid -> tag, sent and not yet answered
        self.given_up: set[int] = set()
        self.next_tag = 0

    @rule()
    def send(self):
        tag = f"t{self.next_tag}"
        self.next_tag += 1
        rid = self.client.start(tag)
        assert rid not in self.sent and rid not in self.given_up
        self.sent[rid] = tag

    @rule(data=st.data())
    def give_up(self, data):
        waiting = sorted(set(self.sent) - self.given_up)
        if waiting:
            rid = data.draw(st.sampled_from(waiting))
            self.client.give_up(rid)
            self.given_up.add(rid)

    @rule(data=st.data())
    def answer_some(self, data):
        """The daemon answers a few requests, in any order, in one read."""
        if not self.sent:
            return
        rids = data.draw(st.lists(st.sampled_from(sorted(self.sent)), min_size=1,
                                  max_size=4, unique=True))
        frames = b"".join(self.server.pong(rid) for rid in rids)
        got = self.client.receive(frames)
        want = [(LATE if rid in self.given_up else self.sent[rid], m.Pong(rid=rid))
                for rid in rids]
        assert got == want
        for rid in rids:
            del self.sent[rid]
            self.given_up.discard(rid)

    @invariant()
    def the_books_agree(self):
        assert self.client.error is None
        assert set(self.client.pending) == set(self.sent) - self.given_up
        assert self.client.orphans == self.given_up


TestClientConnectionMachine = ClientConnectionMachine.TestCase
TestClientConnectionMachine.settings = settings(max_examples=100, stateful_step_count=40,
                                                deadline=None)
