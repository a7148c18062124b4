#!/usr/bin/env python3
"""How fast registry changes reach the daemons: a real ems-control and two ems-server
daemons (registry poll ``--poll-s``, default the daemon's 1.0 s), ``--rounds`` times:

* create a tenant with a key over REST -> until both daemons accept a session of it;
* revoke that key -> until both refuse a new session, and its open sessions are gone;
* change the quota -> until both daemons report the new pool limit.

Times run from the REST answer to the check that saw the change (checks every 20 ms).
Prints a table (p50 and max per event, in seconds) and writes JSON (``--out``).

    python benchmarks/control_propagation.py --rounds 10 --out /tmp/propagation.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from ems.client.remote import RemoteTransport
from ems.errors import EmsException
from ems.testing import run_server
from ems.testing.control import run_control


def _accepts(server, access_id: str, key: str) -> bool:
    try:
        RemoteTransport.connect(server.socket_path, access_id, key, 3.0).close()
        return True
    except EmsException:
        return False


def _until(predicate, timeout_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"no change within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--poll-s", default="1.0")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    results: dict[str, list[float]] = {"new tenant": [], "revoked key": [],
                                       "live session closed": [], "quota": []}
    with tempfile.TemporaryDirectory(prefix="ems-prop-") as d, contextlib.ExitStack() as stack:
        for name in ("control", "h1", "h2"):
            os.makedirs(os.path.join(d, name))
        control = stack.enter_context(run_control(os.path.join(d, "control")))
        hosts = [stack.enter_context(run_server(
            os.path.join(d, name), capacity="256M", anonymous=False, log_level="WARNING",
            extra_args=["--control", control.url, "--control-token-file",
                        control.token_file("daemon"), "--control-poll-s", args.poll_s,
                        "--host-name", name])) for name in ("h1", "h2")]
        for i in range(args.rounds):
            ident = f"bench-{i}"
            _, t = control.call("POST", "/v1/tenants", {"access_id": ident, "quota": "16M",
                                                        "issue_key": True})
            t0 = time.monotonic()
            key, kid = t["key"]["access_key"], t["key"]["key_id"]
            results["new tenant"].append(max(
                _until(lambda s=s, i=ident, k=key: _accepts(s, i, k)) for s in hosts) - t0)
            live = [RemoteTransport.connect(s.socket_path, ident, key, 3.0) for s in hosts]
            control.call("DELETE", f"/v1/tenants/{ident}/keys/{kid}")
            t0 = time.monotonic()
            results["revoked key"].append(max(
                _until(lambda s=s, i=ident, k=key: not _accepts(s, i, k)) for s in hosts) - t0)
            results["live session closed"].append(max(_until(
                lambda s=s, i=ident: s.stats()["tenants"][i]["connections"] == 0)
                for s in hosts) - t0)
            for t in live:
                t.close()
            control.call("PUT", f"/v1/tenants/{ident}/quota", {"quota": "8M"})
            t0 = time.monotonic()
            results["quota"].append(max(_until(
                lambda s=s, i=ident: s.stats()["tenants"][i]["capacity_bytes"] == 8 << 20)
                for s in hosts) - t0)
            control.call("DELETE", f"/v1/tenants/{ident}")
    print(f"registry changes reaching 2 daemons (poll {args.poll_s} s, {args.rounds} rounds), "
          f"seconds after the REST answer")
    print(f"{'event':<22}{'p50':>8}{'max':>8}")
    summary = {}
    for event, times in results.items():
        summary[event] = {"p50_s": statistics.median(times), "max_s": max(times),
                          "samples_s": [round(x, 4) for x in times]}
        print(f"{event:<22}{summary[event]['p50_s']:>8.3f}{summary[event]['max_s']:>8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"poll_s": float(args.poll_s), "rounds": args.rounds,
                       "machine": platform.platform(), "cpus": os.cpu_count(),
                       "events": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
