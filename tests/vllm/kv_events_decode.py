"""Publish KV events with ems's publisher and decode them with vLLM's own decoder
(``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``). Runs inside
the vLLM venv; prints one JSON object: the decoded events, in order.

    python kv_events_decode.py
"""

from __future__ import annotations

import json
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from ems.server.kv_events import KvEventPublisher


def main() -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:0", host="h1",
                           replay_endpoint="tcp://127.0.0.1:0")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.connect(pub.replay_endpoint)
    space = "0123456789abcdef01234567"
    pub.stored("tenant", [5, (1 << 64) - 1], "ems-shm",
               keys=[f"v1:{space}:1", f"v1:{space}:2"])
    pub.evicted("tenant", [f"v1:{space}:2"], "ems-shm")
    pub.stored("tenant", [9], "ems-disk")
    pub.stored("tenant", [9], "ems-cluster")
    pub.stored("tenant", [7], "ems-disk", keys=[f"v1:{space}:3"])
    pub.evicted("tenant", [f"v1:{space}:3"], "ems-disk")  # its region evicted
    deadline = time.monotonic() + 10
    while pub.statistics().published_batches < 7:
        assert time.monotonic() < deadline, pub.statistics()
        time.sleep(0.01)
    req.send_multipart([b"", (0).to_bytes(8, "big")])  # everything, by replay
    out = []
    while True:
        assert req.poll(5000)
        _, topic, seq, payload = req.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        batch = decoder.decode(payload)
        for event in batch.events:
            assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared))
            row = {"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                   "ts": batch.ts, "type": type(event).__name__}
            for name in ("block_hashes", "medium", "locality", "ownership", "token_ids",
                         "block_size", "parent_block_hash"):
                if hasattr(event, name):
                    row[name] = getattr(event, name)
            out.append(row)
    req.close(0)
    ctx.term()
    pub.close()
    print(json.dumps({"events": out}))


if __name__ == "__main__":
    main()
