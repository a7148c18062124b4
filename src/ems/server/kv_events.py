"""KV events: what the pool holds, published in vLLM's own KV-events wire format.

``ems-server --kv-events tcp://HOST:PORT`` binds a ZMQ PUB socket there; subscribers
(KV-aware routers: the ones that read vLLM's events read these) connect to it. Each
message is vLLM 0.32's multipart::

    [topic (UTF-8), seq (8 bytes, big-endian, increasing), msgpack KVEventBatch]

``KVEventBatch`` is ``[ts, [event, ...]]`` (msgspec's array form; ``ts`` in seconds
since the epoch) and each event a map tagged ``"type"``: ``BlockStored``,
``BlockRemoved`` or ``AllBlocksCleared``, with vLLM's field names, so
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` decodes them.

``block_hashes`` are the values vLLM publishes for the same blocks (the low 64 bits of
its block hash, unsigned): the connector sends them with its saves (the ``hashes``
field of ``Reserve`` / ``Put``). The pool never sees tokens, so ``BlockStored`` has
``token_ids`` empty, ``block_size`` 0 and ``parent_block_hash`` None, as vLLM's own
placeholder events of its offloading tiers do; a router matches blocks by hash.

Tiers, in vLLM's vocabulary (``medium``, ``locality``) and by name (``ownership``,
vLLM's "secondary offloading tier identifier"):

=================  ===========  ==========  ==============================
ems tier           ``medium``   locality    ``ownership``
=================  ===========  ==========  ==============================
host shared memory ``CPU``      ``LOCAL``   ``ems-shm``
disk tier          ``STORAGE``  ``LOCAL``   ``ems-disk``
cluster (Valkey)   ``CPU``      ``REMOTE``  ``ems-cluster``
=================  ===========  ==========  ==============================

Topics (ZMQ subscriptions match by prefix): ``kv@<host>@<tenant>@<space>`` where
``space`` names the model as deployed: the SDK's V1 key prefix (a 24-hex-digit hash
of the tenant, the engine, the model id, the parallel ranks and the cache layout; the
connector logs it at start), ``v0`` for V0 keys, ``-`` when unknown. Host-wide events
(``AllBlocksCleared``, sent once at start: a subscriber drops what it knew of this
host) go to ``kv@<host>@``. Subscribe to ``kv@`` for everything, ``kv@<host>@`` for a
host.

Replay (``--kv-events-replay tcp://HOST:PORT``): a ZMQ ROUTER; a client (DEALER or REQ)
sends the first seq it wants (8 bytes big-endian) and gets every buffered message from
there, ``[topic, seq, payload]`` each, then ``[b"", -1 (8 bytes, signed), b""]``: vLLM's
replay protocol.

The queue between the daemon's thread and the publisher's is bounded: when full, the
oldest batch is dropped and counted (``statistics().dropped_batches``), never the
daemon blocked. ``BlockRemoved`` needs the hashes of evicted keys, which the daemon
knows only by key: :meth:`KvEventPublisher.stored` remembers ``key -> hash`` per
tenant (at most ``max_tracked_keys``, the oldest forgotten first and counted), with
the tiers that hold the key (:meth:`KvEventPublisher.copied`: the disk wrote it), and
:meth:`KvEventPublisher.evicted` turns keys back into hashes, forgetting a key when
the last tier holding it removed it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any, Optional, Sequence

import msgpack

from ems.protocol.report import EventsReport

__all__ = ["MEDIUMS", "KvEventPublisher", "KvEventStatistics", "decode_batch"]

logger = logging.getLogger(__name__)

#: ems tier -> (vLLM medium, locality, ownership)
MEDIUMS: dict[str, tuple[str, str, str]] = {
    "ems-shm": ("CPU", "LOCAL", "ems-shm"),
    "ems-disk": ("STORAGE", "LOCAL", "ems-disk"),
    "ems-cluster": ("CPU", "REMOTE", "ems-cluster"),
}
#: ems tier -> its bit in a tracked key's set of tiers
_BIT: dict[str, int] = {name: 1 << i for i, name in enumerate(MEDIUMS)}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK = (1 << 64) - 1


#: Counters of one publisher (cumulative): its part of the daemon's report, one
#: definition (``ems.protocol.report.EventsReport``)
KvEventStatistics = EventsReport


def space_of(key: str) -> str:
    """The key space of a storage key (the topic's last part, see the module doc)."""
    if key.startswith("v1:"):
        end = key.find(":", 3)
        return key[3:end] if end > 3 else "-"
    return "v0" if key.startswith("v0:") else "-"


class KvEventPublisher:
    """A ZMQ PUB of KV events (see the module docstring). Every method is thread-safe
    and returns at once; one thread of its own encodes and sends.

    ``endpoint``/``replay_endpoint``: ``tcp://HOST:PORT`` to bind (port 0: any; the
    bound addresses are :attr:`endpoint` / :attr:`replay_endpoint`). ``host``: this
    daemon's name in the topics. ``max_queue_batches``: batches waiting to be sent at
    most; ``buffer_batches``: sent batches kept for replay; ``max_tracked_keys``:
    ``key -> hash`` entries kept for ``BlockRemoved``.
    """

    def __init__(self, endpoint: str, host: str, *, replay_endpoint: Optional[str] = None,
                 max_queue_batches: int = 100_000, buffer_batches: int = 10_000,
                 max_tracked_keys: int = 1 << 20, hwm: int = 100_000) -> None:
        import zmq  # the optional extra: pip install 'ems[events]'

        if max_queue_batches < 1 or buffer_batches < 1 or max_tracked_keys < 1:
            raise ValueError("KvEventPublisher: queue, buffer and tracked keys must be >= 1")
        self.host = host
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._bind(self._pub, endpoint)
        self._replay = None
        self.replay_endpoint: Optional[str] = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self._max_queue = max_queue_batches
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(
            maxlen=buffer_batches)
        # (tenant, key) -> (tiers holding it << 64) | hash, oldest first: one map for
        # every tier (a key's hash is the same wherever it lives), an entry forgotten
        # when the last tier that held the key removed it
        self._tracked: dict[tuple[str, str], int] = {}
        self._max_tracked = max_tracked_keys
        self._seq = 0
        self._counts = collections.Counter[str]()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ems-kv-events", daemon=True)
        self._thread.start()
        self.cleared()
        logger.info("ems: KV events on %s%s (topics kv@%s@<tenant>@<space>)", self.endpoint,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", host)

    def _bind(self, sock: Any, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[:-2])
            return f"{endpoint[:-2]}:{port}"
        sock.bind(endpoint)
        return endpoint

    # ------------------------------------------------------------ the daemon's calls
    def stored(self, tenant: str, hashes: Sequence[int], medium: str = "ems-shm", *,
               keys: Optional[Sequence[str]] = None, block_size: int = 0) -> None:
        """``BlockStored`` of ``hashes`` (vLLM's, unsigned 64-bit) in tier ``medium``
        for ``tenant``. ``keys`` (the storage keys, parallel to ``hashes``): remembered
        so that :meth:`evicted` can name the hashes of evicted keys, and the topic's
        key space taken from them."""
        hs = [h & _MASK for h in hashes]
        if not hs:
            return
        vllm_medium, locality, ownership = self._medium(medium)
        # (built before taking the lock: the daemon's loop calls this per commit)
        spaces: dict[str, list[int]] = {}
        if keys is not None:
            if len(keys) != len(hs):
                raise ValueError("stored: keys and hashes must have equal lengths")
            first = space_of(keys[0])
            prefix = f"v1:{first}:"
            if first != "-" and all(k.startswith(prefix) for k in keys):
                spaces[first] = hs  # (one request: one key space)
            else:
                for key, h in zip(keys, hs):
                    spaces.setdefault(space_of(key), []).append(h)
        else:
            spaces["-"] = hs
        batches = [(self._topic(tenant, space),
                    {"type": "BlockStored", "block_hashes": group, "parent_block_hash": None,
                     "token_ids": [], "block_size": block_size, "lora_id": None,
                     "medium": vllm_medium, "lora_name": None, "locality": locality,
                     "ownership": ownership})
                   for space, group in spaces.items()]
        with self._lock:
            if keys is not None:
                self._track(tenant, keys, hs, _BIT[medium])
            for topic, event in batches:
                self._put_locked(topic, event)

    def removed(self, tenant: str, hashes: Sequence[int], medium: str = "ems-shm", *,
                space: str = "-") -> None:
        """``BlockRemoved`` of ``hashes`` from tier ``medium``."""
        hs = [h & _MASK for h in hashes]
        if not hs:
            return
        vllm_medium, locality, ownership = self._medium(medium)
        event = {"type": "BlockRemoved", "block_hashes": hs, "medium": vllm_medium,
                 "locality": locality, "ownership": ownership}
        with self._lock:
            self._put_locked(self._topic(tenant, space), event)

    def copied(self, tenant: str, keys: Sequence[str], medium: str) -> None:
        """Keys now also held by tier ``medium`` (the disk wrote them from shared
        memory): ``BlockStored`` there of the hashes :meth:`stored` remembered for
        them; keys it does not know (saved without hashes, or forgotten) publish
        nothing."""
        known_keys: list[str] = []
        known: list[int] = []
        with self._lock:
            for key in keys:
                packed = self._tracked.get((tenant, key))
                if packed is not None:
                    known_keys.append(key)
                    known.append(packed & _MASK)
        if known:
            self.stored(tenant, known, medium, keys=known_keys)

    def evicted(self, tenant: str, keys: Sequence[str], medium: str = "ems-shm", *,
                count_untracked: bool = True) -> None:
        """Keys that left tier ``medium``: ``BlockRemoved`` of the hashes
        :meth:`stored` remembered for them in that tier (keys it does not know there
        are counted, unless ``count_untracked`` is False: a shared tier's misses of
        keys other hosts wrote); a key is forgotten once no tier holds it."""
        bit = _BIT[self._medium(medium)[2]]
        by_space: dict[str, list[int]] = {}
        tracked = self._tracked
        with self._lock:
            for key in keys:
                packed = tracked.get((tenant, key))
                if packed is None or not (packed >> 64) & bit:
                    if count_untracked:
                        self._counts["untracked_removals"] += 1
                    continue
                rest = (packed >> 64) & ~bit
                if rest:
                    tracked[(tenant, key)] = (rest << 64) | (packed & _MASK)
                else:
                    del tracked[(tenant, key)]
                by_space.setdefault(space_of(key), []).append(packed & _MASK)
        for space, hs in by_space.items():
            self.removed(tenant, hs, medium, space=space)

    def tracked(self, medium: str) -> dict[str, list[tuple[str, int]]]:
        """tenant -> (key, hash) of every key it remembers in tier ``medium`` (a
        snapshot: the disk tier keeps it across restarts, ``ems.server.disk_announce``)."""
        bit = _BIT[self._medium(medium)[2]]
        with self._lock:
            items = list(self._tracked.items())
        out: dict[str, list[tuple[str, int]]] = {}
        for (tenant, key), packed in items:
            if (packed >> 64) & bit:
                out.setdefault(tenant, []).append((key, packed & _MASK))
        return out

    def cleared(self) -> None:
        """``AllBlocksCleared`` for this host (at start, and when the pool is emptied)."""
        with self._lock:
            self._tracked.clear()
            self._put_locked(f"kv@{self.host}@".encode(), {"type": "AllBlocksCleared"})

    def statistics(self) -> KvEventStatistics:
        with self._lock:
            c = self._counts
            return KvEventStatistics(
                published_batches=c["batches"], published_events=c["events"],
                published_hashes=c["hashes"], dropped_batches=c["dropped"],
                queued_batches=len(self._queue), replays=c["replays"],
                tracked_keys=len(self._tracked),
                untracked_removals=c["untracked_removals"], next_seq=self._seq)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout_s``), then close the sockets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout_s)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    # ------------------------------------------------------------ internals
    @staticmethod
    def _medium(medium: str) -> tuple[str, str, str]:
        try:
            return MEDIUMS[medium]
        except KeyError:
            raise ValueError(f"unknown ems tier {medium!r}; known: "
                             f"{', '.join(MEDIUMS)}") from None

    def _topic(self, tenant: str, space: str) -> bytes:
        return f"kv@{self.host}@{tenant}@{space}".encode()

    def _track(self, tenant: str, keys: Sequence[str], hashes: list[int], bit: int) -> None:
        tracked = self._tracked
        for key, h in zip(keys, hashes):
            was = tracked.get((tenant, key))
            tiers = bit if was is None else (was >> 64) | bit
            tracked[(tenant, key)] = (tiers << 64) | h
        over = len(tracked) - self._max_tracked
        if over > 0:  # the oldest first (a dict keeps insertion order)
            for old in list(itertools.islice(tracked, over)):
                del tracked[old]

    def _put_locked(self, topic: bytes, event: dict[str, Any]) -> None:
        if self._closed:
            return
        if len(self._queue) >= self._max_queue:
            self._queue.popleft()
            self._counts["dropped"] += 1
        self._queue.append((topic, [time.time(), [event]]))
        if len(self._queue) == 1:  # the sender takes all there is each time it wakes
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue and not self._closed:
                    self._wake.wait(0.05 if self._replay is not None else 1.0)
                batch = list(self._queue)
                self._queue.clear()
                closed = self._closed
            for topic, body in batch:
                self._send(topic, body)
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except self._zmq.ZMQError:
                    logger.exception("ems: KV events replay failed")
            if closed:
                return

    def _send(self, topic: bytes, body: list[Any]) -> None:
        payload = msgpack.packb(body, use_bin_type=True)
        with self._lock:
            seq = self._seq
            self._seq += 1
        seq_bytes = seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((topic, seq_bytes, payload))
        except self._zmq.ZMQError:
            logger.exception("ems: publishing a KV event batch failed")
            return
        self._buffer.append((seq, topic, payload))
        events = body[1]
        with self._lock:
            self._counts["batches"] += 1
            self._counts["events"] += len(events)
            self._counts["hashes"] += sum(len(e.get("block_hashes", ())) for e in events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ems: a bad KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._lock:
            self._counts["replays"] += 1
        for seq, topic, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A batch's ``(ts, events)`` with msgpack alone (routers without vLLM)."""
    body = msgpack.unpackb(payload, raw=False)
    return float(body[0]), list(body[1])
