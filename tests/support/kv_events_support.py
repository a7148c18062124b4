"""A ZeroMQ subscriber of a daemon's KV events, for the tests of the tiers' events."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import pytest

from ems import CcConfig_v1, Ems, EmsConfig


@contextlib.contextmanager
def v1_client(model_id: str, row: int = 512, block_tokens: int = 4) -> Iterator:
    """A V1 ContextCaching of this process on the daemon its environment names, with one
    layer of KV cache ``64 x block_tokens x 2 x row`` (row 512: 16 KiB a block);
    finalized after."""
    import torch
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id=model_id)))
    try:
        cc = Ems.get_cc()
        cc.register_kvcache([[torch.randn(64, block_tokens, 2, row)]])
        yield cc
    finally:
        Ems.finalize()


class Subscriber:
    """A ZeroMQ SUB on a daemon's KV events (``tcp://127.0.0.1:port``, topics ``kv@``):
    :meth:`join` saves one warm-up block at a time until the first batch arrives (a SUB
    joins late), :meth:`drain` hands each batch (its topic, sequence number and events)
    to ``seen`` until ``until()`` or the bounded wait ends."""

    def __init__(self, zmq, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)

    def join(self, cc, opt, block_tokens: int = 4) -> None:
        for warm in range(50):
            assert cc.save(hashes=[9000 + warm], chunk_descs=[[(0, block_tokens)]],
                           option=opt, event_hashes=[9000 + warm]).success == 1
            if self.poller.poll(200):
                return

    def drain(self, until, seen, timeout_s: float) -> None:
        from ems.server.kv_events import decode_batch
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not until():
            if not self.poller.poll(200):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            seen(topic, int.from_bytes(seq, "big"), decode_batch(payload)[1])

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


@pytest.fixture
def subscriber():
    """``subscriber(port)``: a :class:`Subscriber`, closed after the test."""
    zmq = pytest.importorskip("zmq")
    made: list[Subscriber] = []

    def make(port: int) -> Subscriber:
        made.append(Subscriber(zmq, port))
        return made[-1]
    yield make
    for s in made:
        s.close()
