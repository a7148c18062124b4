"""An inference process of one tenant: ``python sdk_client.py JSON``.

``Ems.init`` with the tenant's access_id/access_key (``EMS_POOL=server`` and
``EMS_SOCKET_DIR`` from the environment), V0 save of ``keys`` (values a function of
the key), load them back, print one JSON line: {"saved", "loaded", "wrong"}, or
{"error": EmsErrorCode name, "message"} when the SDK refuses.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper


def pattern(key: str, size: int) -> bytes:
    block = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def main() -> int:
    args = json.loads(sys.argv[1])
    size, keys = args.get("size", 4096), args["keys"]
    try:
        Ems.init(EmsConfig(access_id=args["access_id"], access_key=args["access_key"],
                           cc_config=CcConfig(rank_id=0, device_id=0, model_id="x")))
    except EmsException as exc:
        print(json.dumps({"error": exc.status_code().name, "message": exc.message()}))
        return 0
    try:
        cc = Ems.get_cc()
        option = CcKvOption(timeout=10000)
        bufs = [ctypes.create_string_buffer(pattern(k, size), size) for k in keys]
        saved = cc.save(option, keys, [[KvBufferWrapper(ctypes.addressof(b), size)]
                                       for b in bufs]).success
        out = [ctypes.create_string_buffer(size) for _ in keys]
        loaded = cc.load(option, keys, [[KvBufferWrapper(ctypes.addressof(b), size)]
                                        for b in out]).success
        wrong = sum(1 for k, b in zip(keys[:loaded], out) if b.raw != pattern(k, size))
        print(json.dumps({"saved": saved, "loaded": loaded, "wrong": wrong}))
    finally:
        Ems.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
