"""Initialisation and error handling, from the seeds' code samples.

Run:  python examples/init_and_errors.py
      access_id=my-tenant access_key=$(head -c 32 /dev/urandom | base64) \\
          python examples/init_and_errors.py      # multi-tenant init from the env

``Ems.init`` is once per process; ``Ems.finalize()`` (beyond the seeds) ends the
session so that this one script can show several ways to init. CPU tensors stand in
for the seeds' NPU tensors; fixes of evident bugs in the seeds are marked ``FIX:``.
"""

import os

import torch

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper
from ems.common.exception import EmsErrorCode  # the original SDK's import path

# ---------------------------------------------------------------- "获取ContextCaching对象"
# 初始化cc配置 (the cc config)
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is not initialized.")
    exit(1)
print(f"health: {Ems.check_health()}")  # clients poll this every ~10 s

# ---------------------------------------------------------------- "异常处理" (error message)
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
# 组成键值列表
key_list = ["hello_world"]
data = torch.ones(1, 4, 2, device="cpu")
data_len = data.numel() * data.element_size()
val_list = [[KvBufferWrapper(data.data_ptr, data_len)]]
try:
    result = cc.load(option, key_list, val_list)
    # Nothing was saved under "hello_world": a miss is a result, not an exception.
    print(f"load of a key never saved: {result}")
except EmsException as e:
    print(f"failed to load, message: {e.message()}.")

# Bad input is an exception: EMS_INVALID_ARGUMENT, "my fault, the pool is healthy".
try:
    cc.load(option, ["k" * 128], val_list)  # keys must be shorter than 128
except EmsException as e:
    print(f"failed to load, message: {e.message()}.")
    print(f"status code: {e.status_code().name}")
    assert e.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT

# A different config in the same process is refused until Ems.finalize().
try:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="llama2-13b")))
except EmsException as e:
    print(f"second init: {e.status_code().name}")

# Invalid configs name the field and the rule (ids take what deployments write --
# "cc_kvstore@_@ds_default_ns_001", "org/Model-7B" -- but not empty or control chars).
Ems.finalize()
try:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=8, device_id=0, model_id="")))
except EmsException as e:
    print(f"exception: {e}.")

# ---------------------------------------------------------------- "初始化" (init)
# 默认不使用密钥（access_id/access_key）访问内存池 (by default, no keys):
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
print(f"initialized without keys: {Ems.get_cc() is not None}")
Ems.finalize()  # one init per process: end this session before the next sample

# 多租户场景 (multi-tenancy): access_id/access_key, issued by the auth component
# through the control-plane REST API, come from the environment.
# FIX: the seed does not import CcConfig in this sample (it is imported above).
# 通过环境变量获取access_id及access_key
access_id = os.getenv("access_id", None)
access_key = os.getenv("access_key", None)
# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(access_id=access_id, access_key=access_key, cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
print(f"initialized with access_id={access_id}: {Ems.get_cc() is not None}")
Ems.finalize()
