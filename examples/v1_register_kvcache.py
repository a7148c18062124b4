"""The official ``register_kvcache`` sample: a V0 config at init, then V1 calls.

Run:  python examples/v1_register_kvcache.py

The original documents' sample initialises with ``EmsConfig(cc_config=CcConfig(
rank_id=8, device_id=0, model_id="llama2-13b"))`` -- a V0 config -- and then
registers the paged KV cache and saves/loads through the V1 API. ems gives the V1-only
fields their documented defaults (``ems.config.v1_from_v0``: llm_engine "vllm", MHA,
this rank's tp/pp positions from rank_id, 0 and 0 here). CPU tensors stand in for the
seeds' NPU memory.
"""

import torch

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException

# 初始化cc配置 (a V0 cc config, as in the sample)
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
try:
    Ems.init(EmsConfig(cc_config=cc_config))
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()

# 注册KVCache (per layer its K and V: [num_blocks, block_size, num_heads, head_size])
num_layers, num_blocks, block_size, num_heads, head_size = 2, 8, 16, 2, 64
torch.manual_seed(0)
kv_caches = [[torch.randn(num_blocks, block_size, num_heads, head_size,
                          dtype=torch.float16) for _ in ("K", "V")]
             for _ in range(num_layers)]
try:
    cc.register_kvcache(kv_caches)
except EmsException as e:
    print(f"failed to register kvcache, {e}.")
    exit(1)
print("register_kvcache: ok")

option = CcKvOption(timeout=5000)
hashes, offsets = [0x5EED, 0x5EEE], [block_size, block_size]
slot_mapping = list(range(2 * block_size))  # blocks 0 and 1
print(f"saved: {cc.save(slot_mapping, hashes, offsets, option)}")
load_slots = list(range(4 * block_size, 6 * block_size))  # into blocks 4 and 5
print(f"loaded: {cc.load(load_slots, hashes, offsets, option)}")
same = all(torch.equal(t[4:6], t[0:2]) for layer in kv_caches for t in layer)
print(f"loaded KV equals saved KV: {same}")
Ems.finalize()
