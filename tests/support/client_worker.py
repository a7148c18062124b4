"""A client process for the integration tests: ``python client_worker.py COMMAND JSON``.

It uses the SDK exactly as an inference process does (``Ems.init`` with
``EMS_POOL=server`` from its environment, then V0 save/load of host buffers) and
prints one JSON line with what happened. Values are a pure function of the key
(:func:`pattern`), so any process can check any key's bytes.

Commands (JSON fields):

* ``save``   keys, size -> {"success"}
* ``load``   keys, size -> {"success", "wrong"}: wrong = loaded keys with bad bytes
* ``mixed``  seed, rounds, key_space, size, batch -> {"saved", "loaded", "wrong",
  "errors", "codes", "late"}: random batches of saves and loads (several in flight at
  once); ``late`` counts loads that raised and whose buffers changed afterwards
* ``slow-save`` / ``slow-load`` keys, size: prints "copying" once the first copy
  started, then copies very slowly (the test kills or stops it)

Optional fields: access_id, access_key, timeout_ms.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import random
import sys
import time

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper
from ems.client import copy as _copy


def pattern(key: str, size: int) -> bytes:
    block = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


class Value:
    """A key's value in two host buffers (like K and V of one block)."""

    def __init__(self, size: int, data: bytes = b"") -> None:
        half = size // 2
        self.parts = [ctypes.create_string_buffer(half), ctypes.create_string_buffer(size - half)]
        if data:
            ctypes.memmove(self.parts[0], data[:half], half)
            ctypes.memmove(self.parts[1], data[half:], size - half)

    def wrappers(self) -> list[KvBufferWrapper]:
        return [KvBufferWrapper(ctypes.addressof(p), len(p)) for p in self.parts]

    def bytes(self) -> bytes:
        return b"".join(p.raw for p in self.parts)


def save(cc, option, keys: list[str], size: int):
    values = [Value(size, pattern(k, size)) for k in keys]
    return cc.async_save(option, keys, [v.wrappers() for v in values]), values


def load(cc, option, keys: list[str], size: int):
    values = [Value(size) for _ in keys]
    return cc.async_load(option, keys, [v.wrappers() for v in values]), values


def count_wrong(keys: list[str], values: list[Value], success: int, size: int) -> int:
    return sum(1 for k, v in zip(keys[:success], values) if v.bytes() != pattern(k, size))


def main() -> int:
    command, args = sys.argv[1], json.loads(sys.argv[2])
    Ems.init(EmsConfig(access_id=args.get("access_id"), access_key=args.get("access_key"),
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="itest")))
    cc = Ems.get_cc()
    option = CcKvOption(timeout=args.get("timeout_ms", 20000),
                        write_out=args.get("write_out", True))
    size = args.get("size", 4096)
    out: dict = {}
    if command == "save":
        fut, _ = save(cc, option, args["keys"], size)
        out["success"] = fut.result().success
    elif command == "load":
        fut, values = load(cc, option, args["keys"], size)
        res = fut.result()
        out = {"success": res.success, "wrong": count_wrong(args["keys"], values,
                                                           res.success, size)}
    elif command == "mixed":
        rng = random.Random(args["seed"])
        if args.get("slow_copy_ms"):  # copies slower than the deadline: timeouts mid-copy
            real, pause = _copy.copy_bytes, args["slow_copy_ms"] / 1000.0

            def slowed(dst: int, src: int, n: int) -> None:
                time.sleep(pause)
                real(dst, src, n)
            _copy.copy_bytes = slowed
        out = {"saved": 0, "loaded": 0, "wrong": 0, "errors": 0, "late": 0}
        late: list = []  # buffers of loads that raised, as they were at the raise
        for _ in range(args["rounds"]):
            inflight = []
            for _ in range(4):  # several requests in flight on one connection
                start = rng.randrange(args["key_space"])
                keys = [f"k{(start + i) % args['key_space']}" for i in range(args["batch"])]
                op = rng.choice(("save", "load"))
                fut, values = (save if op == "save" else load)(cc, option, keys, size)
                inflight.append((op, keys, fut, values))
            for op, keys, fut, values in inflight:
                try:
                    res = fut.result()
                except EmsException as exc:
                    out["errors"] += 1
                    kind = exc.status_code().name
                    out.setdefault("codes", {})[kind] = out.get("codes", {}).get(kind, 0) + 1
                    if op == "load":  # nothing may land in these buffers from now on
                        late.append((values, [v.bytes() for v in values]))
                    continue
                if op == "save":
                    out["saved"] += res.success
                else:
                    out["loaded"] += res.success
                    out["wrong"] += count_wrong(keys, values, res.success, size)
        time.sleep(0.2)  # a late write would have landed by now
        out["late"] = sum(1 for values, seen in late
                          if [v.bytes() for v in values] != seen)
    elif command in ("slow-save", "slow-load"):
        real = _copy.copy_bytes
        announced = []

        def slow(dst: int, src: int, n: int) -> None:
            if not announced:
                announced.append(True)
                print("copying", flush=True)
            time.sleep(0.5)
            real(dst, src, n)
        _copy.copy_bytes = slow
        fut, _ = (save if command == "slow-save" else load)(cc, option, args["keys"], size)
        out["success"] = fut.result().success
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(out), flush=True)
    Ems.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
