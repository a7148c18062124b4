"""Save two values and load them back, with no torch (the quickstart's example).

Run:  python examples/quickstart.py

V0 (key lists) works on raw host memory, so this runs wherever ems is installed: on the
embedded pool when no daemon is running, or on ``ems-server`` when one serves
``$EMS_SOCKET_DIR`` (``EMS_POOL=server`` insists on the daemon).
"""

import ctypes

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper

try:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="demo-model")))
except EmsException as e:  # no daemon (yet), bad config, refused credentials
    print(f"init failed: {e.status_code().name}: {e.message()}")
    raise SystemExit(1) from e
cc = Ems.get_cc()
assert cc is not None

# two values of 4 KiB in this process's memory; any host pointer and length will do
saved = [ctypes.create_string_buffer(bytes([i]) * 4096, 4096) for i in (1, 2)]
keys = ["prefix-block-0", "prefix-block-1"]
option = CcKvOption(timeout=5000)  # ms; 0: no deadline

result = cc.save(option, keys, [[KvBufferWrapper(ctypes.addressof(b), 4096)] for b in saved])
print(f"saved: {result}")                               # CcResult(success=2, total=2)

loaded = [ctypes.create_string_buffer(4096) for _ in keys]
result = cc.load(option, keys, [[KvBufferWrapper(ctypes.addressof(b), 4096)] for b in loaded])
print(f"loaded: {result}")                              # CcResult(success=2, total=2)
print(f"bytes equal: {[b.raw for b in loaded] == [b.raw for b in saved]}")
Ems.finalize()
