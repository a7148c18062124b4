"""A reference KV-aware router over ems's KV events (docs/kv-events.md).

It subscribes to several ``ems-server --kv-events`` endpoints (or vLLM engines: the
format is vLLM's), keeps per host which block hashes each tier holds, and picks for a
prompt the host with the longest cached prefix, each block weighted by the best tier
that holds it (shared memory 1.0, disk 0.5, cluster 0.25 by default)::

    router = KvRouter({"host-a": "tcp://host-a:5557", "host-b": "tcp://host-b:5557"})
    host, score = router.pick(block_hashes)      # None when no host holds block 0

``block_hashes`` are the prompt's vLLM block hashes as vLLM publishes them (the low 64
bits, unsigned; with vLLM installed, :func:`prompt_hashes` computes them for sha256 and
no PYTHONHASHSEED, vLLM's defaults). A prefix counts only while it is unbroken: block
``i`` helps only when blocks ``0..i-1`` are there too (a prefix cache needs them all).

Tiers by their labels: ems names its tier in ``ownership`` (``ems-shm``, ``ems-disk``,
``ems-cluster``; ``medium`` CPU / STORAGE / CPU with locality REMOTE), vLLM's own tiers
only in ``medium``. A block evicted from a
host's shared memory but still on its disk stays there at the disk's weight, so a host
whose disk holds a prefix beats one that holds none, and one whose memory holds it
beats a disk (``tests/integration/test_kv_router.py`` checks both on real daemons).

A gap in a host's sequence numbers means lost messages: this router then forgets that
host (a real router would ask the replay endpoint). ``AllBlocksCleared`` forgets it too.

Run without arguments, it demonstrates itself on two in-process publishers: it picks
the host that holds a prefix, then the other one once that host evicts it.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional, Sequence

import msgpack
import zmq

#: weight of a block by the tier that holds it (``ownership`` names ems's tiers; other
#: publishers, e.g. vLLM itself, by ``medium``)
TIER_WEIGHTS = {"ems-shm": 1.0, "ems-disk": 0.5, "ems-cluster": 0.25,
                "GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}


class KvRouter:
    """See the module docstring. ``endpoints``: host name -> ZMQ PUB endpoint."""

    def __init__(self, endpoints: dict[str, str], weights: Optional[dict[str, float]] = None
                 ) -> None:
        self.weights = dict(TIER_WEIGHTS if weights is None else weights)
        self._ctx = zmq.Context()
        self._sockets = {}
        for host, endpoint in endpoints.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self._sockets[sub] = host
        self._lock = threading.Lock()
        # host -> block hash -> {tier: copies}
        self._blocks: dict[str, dict[int, collections.Counter]] = {
            h: {} for h in endpoints}
        self._last_seq: dict[str, int] = {}
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-router")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sub in self._sockets:
            sub.close(0)
        self._ctx.term()

    def held(self, host: str) -> int:
        """Blocks ``host`` holds in any tier, as far as this router knows."""
        with self._lock:
            return len(self._blocks[host])

    def pick(self, block_hashes: Sequence[int]) -> tuple[Optional[str], float]:
        """The host with the best weighted unbroken prefix of ``block_hashes``."""
        best: tuple[Optional[str], float] = (None, 0.0)
        with self._lock:
            for host, blocks in self._blocks.items():
                score = 0.0
                for h in block_hashes:
                    tiers = blocks.get(h)
                    if not tiers:
                        break
                    score += max(self.weights.get(t, 0.1) for t in tiers)
                if score > best[1]:
                    best = (host, score)
        return best

    # ------------------------------------------------------------ events
    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._sockets:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(100):
                _topic, seq_bytes, payload = sub.recv_multipart()
                self._apply(self._sockets[sub], int.from_bytes(seq_bytes, "big"),
                            msgpack.unpackb(payload, raw=False))

    def _apply(self, host: str, seq: int, batch: list) -> None:
        with self._lock:
            last = self._last_seq.get(host)
            if last is not None and seq != last + 1:
                self._blocks[host] = {}  # lost messages: start over for this host
            self._last_seq[host] = seq
            blocks = self._blocks[host]
            for event in batch[1]:
                self.events += 1
                kind = event.get("type")
                tier = event.get("ownership") or event.get("medium") or "?"
                if kind == "AllBlocksCleared":
                    blocks.clear()
                elif kind == "BlockStored":
                    for h in event["block_hashes"]:
                        blocks.setdefault(h, collections.Counter())[tier] += 1
                elif kind == "BlockRemoved":
                    for h in event["block_hashes"]:
                        tiers = blocks.get(h)
                        if tiers is not None:
                            tiers[tier] -= 1
                            if tiers[tier] <= 0:
                                del tiers[tier]
                            if not tiers:
                                del blocks[h]


def prompt_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """A prompt's full-block hashes as vLLM publishes them (vLLM installed; sha256
    and no PYTHONHASHSEED, vLLM's defaults; no LoRA, multimodal or cache salt)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu
    kcu.init_none_hash(sha256_cbor)
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = kcu.hash_block_tokens(sha256_cbor, parent,
                                       token_ids[i * block_size:(i + 1) * block_size])
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit("the router did not see the events in time")
        time.sleep(0.01)


def main() -> None:
    from ems.server.kv_events import KvEventPublisher

    a = KvEventPublisher("tcp://127.0.0.1:0", host="host-a")
    b = KvEventPublisher("tcp://127.0.0.1:0", host="host-b")
    router = KvRouter({"host-a": a.endpoint, "host-b": b.endpoint})
    time.sleep(0.5)  # subscriptions reach the publishers
    prompt = [101, 102, 103, 104]  # a prompt's 4 block hashes
    space = "0123456789abcdef01234567"
    keys = [f"v1:{space}:{i}" for i in range(4)]
    a.stored("tenant", prompt, "ems-shm", keys=keys)  # all 4 blocks in host-a's memory
    b.stored("tenant", prompt, "ems-shm", keys=keys)  # and in host-b's,
    b.copied("tenant", keys, "ems-disk")  # written to host-b's disk,
    b.evicted("tenant", keys[2:], "ems-shm")  # 2 of them since only there
    _wait(lambda: router.held("host-a") == 4 and router.held("host-b") == 4)
    print("prefix held: pick %s (score %.2f)" % router.pick(prompt))
    a.evicted("tenant", keys[:1])  # host-a loses block 0: its prefix is broken
    _wait(lambda: router.held("host-a") == 3)
    print("after host-a evicted block 0: pick %s (score %.2f)" % router.pick(prompt))
    print("unknown prompt: pick %s (score %.2f)" % router.pick([7, 8]))
    router.close()
    a.close()
    b.close()


if __name__ == "__main__":
    main()
