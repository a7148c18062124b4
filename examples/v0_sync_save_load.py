"""V0 (key lists): synchronous save and load, from the seeds' code samples.

Run:  python examples/v0_sync_save_load.py

The seeds target Ascend NPUs (``import torch_npu``, ``device="npu:1"``); here every
tensor is a CPU tensor, which the embedded pool handles with nothing else started.
Fixes of evident bugs in the seeds are marked ``FIX:``. The seeds pass
``tensor.data_ptr`` without the call parentheses; ``KvBufferWrapper`` accepts that
(it calls it), so it is kept as in the seeds.
"""

import torch

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper, PrimaryKey

# ---------------------------------------------------------------- "读写Context Caching"
# 初始化cc配置 (the cc config)
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems (init Ems, once per process)
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
# 获取context caching对象 (get the context caching object)
cc = Ems.get_cc()
if cc is None:
    exit(1)
# 设置save请求的超时时间 (request timeout, ms)
option = CcKvOption(timeout=5000)
# 保存一个tensor (save one tensor)
data = torch.ones(6, device="cpu")
length = data.numel() * data.element_size()
key_list = ["hello"]
val_list = [[KvBufferWrapper(data.data_ptr, length)]]
try:
    cc_result = cc.save(option, key_list, val_list)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
print(cc_result)
# 读取保存的tensor数据到新的tensor，保证跟之前保存的的tensor一样的shape和dtype
# (read the saved data back into a new tensor of the same shape and dtype)
# FIX: the seed calls torch.zero, which does not exist: torch.zeros.
data2 = torch.zeros(6, device="cpu")
# FIX: the seed passes `len` (the builtin function) as the length: `length`.
val_list = [[KvBufferWrapper(data2.data_ptr, length)]]
try:
    # FIX: the seed calls cc.save again here; reading back is cc.load.
    cc_result = cc.load(option, key_list, val_list)
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(1)
print(cc_result)
print(f"loaded tensor equals saved tensor: {torch.equal(data, data2)}")

# ---------------------------------------------------------------- "同步保存KVCache", V0
option = CcKvOption(timeout=5000)
# 组成键值列表 (keys and values)
key_list = [PrimaryKey("1", "123"), PrimaryKey("1", "66")]
tensor1 = torch.ones(2, device="cpu")
tensor2 = torch.ones(6, device="cpu")
len1 = tensor1.numel() * tensor1.element_size()
len2 = tensor2.numel() * tensor2.element_size()
val_list = [[KvBufferWrapper(tensor1.data_ptr, len1)], [KvBufferWrapper(tensor2.data_ptr, len2)]]
# 可以根据不同异常，采取不同处理方式，例如超时错误可以重试。
# (handle each error as fits, e.g. retry on a timeout)
try:
    cc_result = cc.save(option, key_list, val_list)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)

# ---------------------------------------------------------------- "数据保存" / "数据加载"
option = CcKvOption(timeout=5000)
key_list = ["123", "66"]
tensor1 = torch.arange(2, dtype=torch.float32, device="cpu")
tensor2 = torch.arange(6, dtype=torch.float32, device="cpu")
len1 = tensor1.numel() * tensor1.element_size()
len2 = tensor2.numel() * tensor2.element_size()
val_list = [[KvBufferWrapper(tensor1.data_ptr, len1)], [KvBufferWrapper(tensor2.data_ptr, len2)]]
try:
    cc_result = cc.save(option, key_list, val_list)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)

# The load sample fills tensors of the same sizes (the seed loads into torch.ones
# tensors; zeros here, so that the loaded values are visible).
out1 = torch.zeros(2, device="cpu")
out2 = torch.zeros(6, device="cpu")
val_list = [[KvBufferWrapper(out1.data_ptr, len1)], [KvBufferWrapper(out2.data_ptr, len2)]]
try:
    cc_result = cc.load(option, key_list, val_list)
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(2)
print(f"succeed to load key num {cc_result.success}.")
print(cc_result)
ok = torch.equal(out1, tensor1) and torch.equal(out2, tensor2)
print(f"loaded tensors equal saved tensors: {ok}")

Ems.finalize()  # optional: a clean shutdown (beyond the seeds)
exit(0 if ok else 3)
