"""V0 (key lists): asynchronous save and load, from the seeds' code samples.

Run:  python examples/v0_async.py

Several requests are submitted first and their futures collected afterwards: that
is how clients get concurrency. CPU tensors stand in for the seeds' NPU tensors
(``device="npu:1"`` -> ``"cpu"``, no ``torch_npu``); fixes of evident bugs in the
seeds are marked ``FIX:``.
"""

import time

import torch

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper, PrimaryKey

cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)

# ---------------------------------------------------------------- "异步保存KVCache", V0
# 设置save请求的超时时间 (request timeout, ms)
option = CcKvOption(timeout=5000)
# 组成键值列表 (keys and values)
key_list = ["123", "66"]
key_list2 = ["hello_world"]
tensor1 = torch.ones(2, device="cpu")
tensor2 = torch.ones(6, device="cpu")
tensor3 = torch.ones(1, 4, 2, device="cpu")
len1 = tensor1.numel() * tensor1.element_size()
len2 = tensor2.numel() * tensor2.element_size()
val_list = [[KvBufferWrapper(tensor1.data_ptr, len1)], [KvBufferWrapper(tensor2.data_ptr, len2)]]
# FIX: the seed computes len3 = tensor2.numel() * tensor3.element_size() (24 bytes) and
# wraps tensor1 (8 bytes) with it: a load would write 16 bytes past tensor1. The value
# of "hello_world" is tensor3, all of it.
len3 = tensor3.numel() * tensor3.element_size()
val_list2 = [[KvBufferWrapper(tensor3.data_ptr, len3)]]
future_list = []
# 多次异步下发异步save请求，增加save并发能力。
# (submit several async saves: more saves in flight at once)
try:
    for _ in range(2):
        future_list.append(cc.async_save(option, key_list, val_list))
        future_list.append(cc.async_save(option, key_list2, val_list2))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        # FIX: the seed prints "rsult".
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
    exit(2)

# ---------------------------------------------------------------- "异步加载KVCache", V0
# The load sample reads PrimaryKeys: save them first (the sync save sample's keys).
option = CcKvOption(timeout=5000)
key_list = [PrimaryKey("1", "123"), PrimaryKey("1", "66")]
key_list2 = [PrimaryKey("2", "hello_world")]
src1 = torch.arange(2, dtype=torch.float32)
src2 = torch.arange(6, dtype=torch.float32)
src3 = torch.arange(8, dtype=torch.float32).reshape(1, 4, 2)
saved = cc.save(option, key_list + key_list2,
                [[KvBufferWrapper(t.data_ptr(), t.numel() * t.element_size())]
                 for t in (src1, src2, src3)])
print(f"saved for the load sample: {saved}")

tensor1 = torch.ones(2, device="cpu")
tensor2 = torch.ones(6, device="cpu")
tensor3 = torch.ones(1, 4, 2, device="cpu")
len1 = tensor1.numel() * tensor1.element_size()
len2 = tensor2.numel() * tensor2.element_size()
val_list = [[KvBufferWrapper(tensor1.data_ptr, len1)], [KvBufferWrapper(tensor2.data_ptr, len2)]]
# FIX: as above, len3 is tensor3's size and the buffer is tensor3 (the seed writes 24
# bytes into the 8 bytes of tensor1).
len3 = tensor3.numel() * tensor3.element_size()
val_list2 = [[KvBufferWrapper(tensor3.data_ptr, len3)]]
future_list = []
# 多次异步下发异步load请求，增加load并发能力。
# (submit several async loads: more loads in flight at once)
try:
    for _ in range(2):
        future_list.append(cc.async_load(option, key_list, val_list))
        future_list.append(cc.async_load(option, key_list2, val_list2))
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
    exit(2)

# Beyond the seeds: clients also poll with cc.is_ready(future) and cc.get_result(future).
future = cc.async_load(option, key_list2, val_list2)
while not cc.is_ready(future):
    time.sleep(0.001)  # serve other work here
print(f"get_result: {cc.get_result(future)}")

ok = torch.equal(tensor1, src1) and torch.equal(tensor2, src2) and torch.equal(tensor3, src3)
print(f"loaded tensors equal saved tensors: {ok}")
Ems.finalize()
exit(0 if ok else 3)
