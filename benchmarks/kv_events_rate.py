#!/usr/bin/env python3
"""KV events: how many the publisher sends per second, and how long from a
``stored()`` call to a subscriber holding the decoded batch.

    python benchmarks/kv_events_rate.py [--batches 20000] [--hashes 16] [--out FILE]

One ``KvEventPublisher`` on localhost TCP and one SUB subscriber in this process
(another thread). The caller publishes ``--batches`` BlockStored events of
``--hashes`` block hashes each (a 512-token save in 32-token blocks), as fast as it
can, then at a paced rate (``--paced-per-s``) to measure the delay without a backlog:
the delay is from just before ``stored()`` to the subscriber's decoded batch (the
daemon's own part, from a save's commit to its ``stored()`` call, is one function call
once the daemon is wired to the publisher). Prints a table, writes JSON (default
``bench-results/kv_events.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(batches: int, hashes: int, paced_per_s: float) -> dict:
    import zmq

    from ems.server.kv_events import KvEventPublisher, decode_batch

    pub = KvEventPublisher("tcp://127.0.0.1:0", host="bench", max_queue_batches=1 << 20)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@bench@t@")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(pub.endpoint)
    time.sleep(0.5)
    got: dict[int, float] = {}  # first hash of a batch -> when it was decoded
    done = threading.Event()

    def receive() -> None:
        while not done.is_set():
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                _, events = decode_batch(payload)
                got[events[0]["block_hashes"][0]] = time.perf_counter()

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    keys = [f"v1:0123456789abcdef01234567:{i}" for i in range(hashes)]

    def wait_for(n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.005)

    # 1. flat out: the publisher's rate
    t0 = time.perf_counter()
    for b in range(batches):
        base = b * hashes
        pub.stored("t", range(base, base + hashes), "ems-shm", keys=keys)
    call_s = time.perf_counter() - t0
    wait_for(batches)
    flat_s = max(got.values()) - t0 if got else float("nan")
    received_flat = len(got)
    # 2. paced: the delay of one event without a backlog
    got.clear()
    sent_at: dict[int, float] = {}
    paced = min(batches, 2000)
    gap = 1.0 / paced_per_s
    for b in range(paced):
        base = (batches + b) * hashes
        sent_at[base] = time.perf_counter()
        pub.stored("t", range(base, base + hashes), "ems-shm", keys=keys)
        time.sleep(gap)
    wait_for(paced)
    delays = sorted(got[h] - sent_at[h] for h in got if h in sent_at)
    done.set()
    thread.join()
    stats = pub.statistics()
    pub.close()
    sub.close(0)
    ctx.term()
    q = lambda p: delays[min(len(delays) - 1, int(p * len(delays)))] if delays else None  # noqa: E731
    return {
        "batches": batches, "hashes_per_batch": hashes,
        "stored_call_us": 1e6 * call_s / batches,
        "events_per_s": received_flat / flat_s if flat_s else None,
        "hashes_per_s": received_flat * hashes / flat_s if flat_s else None,
        "received": received_flat, "dropped_batches": stats.dropped_batches,
        "paced_per_s": paced_per_s, "paced_batches": paced,
        "delay_ms": {"median": 1e3 * statistics.median(delays) if delays else None,
                     "p90": 1e3 * q(0.9) if delays else None,
                     "p99": 1e3 * q(0.99) if delays else None,
                     "max": 1e3 * delays[-1] if delays else None},
        "cpus": os.cpu_count(),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--hashes", type=int, default=16)
    ap.add_argument("--paced-per-s", type=float, default=500.0)
    ap.add_argument("--out", default=os.path.join(REPO, "bench-results", "kv_events.json"))
    args = ap.parse_args(argv)
    r = run(args.batches, args.hashes, args.paced_per_s)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(r, f, indent=1)
    d = r["delay_ms"]
    print(f"KV events, BlockStored of {args.hashes} hashes each")
    print(f"  stored() call            {r['stored_call_us']:8.1f} us")
    print(f"  published and decoded    {r['events_per_s']:8.0f} events/s "
          f"({r['hashes_per_s']:.0f} block hashes/s), {r['received']} of {args.batches}")
    print(f"  stored() -> subscriber   median {d['median']:.2f} ms, p90 {d['p90']:.2f} ms, "
          f"p99 {d['p99']:.2f} ms ({args.paced_per_s:.0f} events/s paced)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
