"""V1 (paged KV cache), slot_mapping semantics: slot_mapping + hashes + offsets.

Run:  python examples/v1_slot_mapping.py

V1 calls need a ``CcConfig_v1`` at ``Ems.init`` and the paged KV cache registered
once with ``cc.register_kvcache`` (the seeds' samples start after that point). Each
layer registers its K and V tensors, ``[num_blocks, block_size, num_heads,
head_size]``; a token's slot is ``block * block_size + position``; ``hashes[i]``
names the block whose tokens are the next ``offsets[i]`` entries of ``slot_mapping``.
CPU tensors stand in for the seeds' NPU memory. Fixes of evident bugs in the seeds
are marked ``FIX:``.
"""

import torch

from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsException
from ems.cc_v1.cc_config import KVCacheType

# ---------------------------------------------------------------- setup (beyond the seeds)
cc_config_v1 = CcConfig_v1(rank_id=0, device_id=0, model_id="llama2-13b",
                           tp_world_size=1, rank_in_tp_group=0, llm_engine="vllm@example")
cc_config_v1.kvcache_type = KVCacheType.MHA  # MLA models: KVCacheType.MLA
try:
    Ems.init(EmsConfig(cc_config_v1=cc_config_v1))
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)

num_layers, num_blocks, block_size, num_heads, head_size = 2, 8, 4, 2, 16
torch.manual_seed(0)
kv_caches = [[torch.randn(num_blocks, block_size, num_heads, head_size,
                          dtype=torch.float16, device="cpu") for _ in ("K", "V")]
             for _ in range(num_layers)]
cc.register_kvcache(kv_caches)


def tokens(slots):
    """The K and V rows of these slots in every layer (to check what was loaded)."""
    s = torch.tensor(slots)
    return [t[s // block_size, s % block_size].clone() for layer in kv_caches for t in layer]


# ---------------------------------------------------------------- "同步保存KVCache", V1
# 设置请求的超时时间 (request timeout, ms)
option = CcKvOption(timeout=5000)
block_size = 4
# 组成参数列表 (two blocks of 4 tokens: slots 0..7)
slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
# 可以根据不同异常，采取不同处理方式，例如超时错误可以重试。
try:
    cc_result = cc.save(slot_mapping=slot_mapping, hashes=hashes, offsets=offsets, option=option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)

# Beyond the seeds: how many leading blocks are cached, without copying them.
print(f"exists: {cc.exists([0xABCD, 0x1234, 0x9999])}")

# ---------------------------------------------------------------- async save
# The async-load sample below reads blocks 0x1111, 0x2222, 0xAAAA and 0xBBBB: save
# them first (from slots 0..7 and 16..23), asynchronously.
futures = [
    cc.async_save(slot_mapping=list(range(0, 8)), hashes=[0x1111, 0x2222], offsets=[4, 4],
                  option=option),
    cc.async_save(slot_mapping=list(range(16, 24)), hashes=[0xAAAA, 0xBBBB], offsets=[4, 4],
                  option=option),
]
for future in futures:
    print(f"saved:{future.result()}")
want_1111 = tokens(range(0, 8))
want_aaaa = tokens(range(16, 24))
for layer in kv_caches:  # forget the cache, as a new request would find it
    for t in layer:
        t.zero_()

# ---------------------------------------------------------------- "异步加载KVCache", V1
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
# 多次异步下发异步load请求，增加load并发能力。
# (submit several async loads: more loads in flight at once)
try:
    # FIX: the seed's slot_mapping is [0, 1, 2, 3, 4, 5] with offsets [4, 4]; the rule
    # sum(offsets) == len(slot_mapping) needs 8 slots.
    slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]
    hashes = [0x1111, 0x2222]
    offsets = [4, 4]
    future_list.append(cc.async_load(slot_mapping=slot_mapping, hashes=hashes,
                                     offsets=offsets, option=option))
    slot_mapping = [10, 11, 12, 13, 14, 15, 16, 17]
    hashes = [0xAAAA, 0xBBBB]
    offsets = [4, 4]
    # FIX: the seed has a typo, "cc.async_ load (...)".
    future_list.append(cc.async_load(slot_mapping=slot_mapping, hashes=hashes,
                                     offsets=offsets, option=option))
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        # FIX: the seed prints "rsult".
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
    exit(2)

ok = all(torch.equal(a, b) for a, b in zip(tokens(range(0, 8)), want_1111)) and all(
    torch.equal(a, b) for a, b in zip(tokens(range(10, 18)), want_aaaa))
print(f"loaded KV equals saved KV: {ok}")
Ems.finalize()
exit(0 if ok else 3)
