"""V1 (paged KV cache), chunk_descs semantics: hashes + chunk_descs.

Run:  python examples/v1_chunk_descs.py

``chunk_descs[g][i] = (start_slot, length)``: chunk ``i`` (named ``hashes[i]``) of
layer group ``g`` is the slots ``[start_slot, start_slot + length)``. One group of
all layers by default; hybrid models whose layers have different cache layouts
register several with ``store_layer_group_desc`` (part 2). CPU tensors stand in for
the seeds' NPU memory; the seeds' samples start after ``register_kvcache``.
"""

import torch

from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsException

# ---------------------------------------------------------------- setup (beyond the seeds)
cc_config_v1 = CcConfig_v1(rank_id=0, device_id=0, model_id="llama2-13b",
                           llm_engine="vllm@example")
try:
    Ems.init(EmsConfig(cc_config_v1=cc_config_v1))
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)

num_layers, num_blocks, block_size = 2, 8, 4
torch.manual_seed(0)
kv_caches = [[torch.randn(num_blocks, block_size, 2, 16, dtype=torch.bfloat16)
              for _ in ("K", "V")] for _ in range(num_layers)]
cc.register_kvcache(kv_caches)  # one layer group: chunk_descs has one inner list


def tokens(caches, slots):
    s = torch.tensor(list(slots))
    return [t[s // t.shape[1], s % t.shape[1]].clone() for layer in caches for t in layer]


# ---------------------------------------------------------------- "同步保存KVCache", V1
# 设置请求的超时时间 (request timeout, ms)
option = CcKvOption(timeout=5000)
block_size = 4
# 组成参数列表 (two chunks of 4 tokens: slots 0..3 and 4..7)
hashes = [0xABCD, 0x1234]
chunk_descs = [[(0, 4), (4, 4)]]
try:
    cc_result = cc.save(hashes=hashes, chunk_descs=chunk_descs, option=option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)

# The async-load sample reads 0x1111/0x2222 and 0xAAAA/0xBBBB: save them first.
futures = [cc.async_save(hashes=[0x1111, 0x2222], chunk_descs=[[(0, 4), (4, 4)]]),
           cc.async_save(hashes=[0xAAAA, 0xBBBB], chunk_descs=[[(16, 4), (20, 4)]])]
for future in futures:
    print(f"saved:{future.result()}")
want_1111 = tokens(kv_caches, range(0, 8))
want_aaaa = tokens(kv_caches, range(16, 24))
for layer in kv_caches:
    for t in layer:
        t.zero_()

# ---------------------------------------------------------------- "异步加载KVCache", V1
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
# 多次异步下发异步load请求，增加load并发能力。
try:
    for _ in range(2):
        hashes = [0x1111, 0x2222]
        chunk_descs = [[(0, 4), (4, 4)]]
        future_list.append(cc.async_load(hashes=hashes, chunk_descs=chunk_descs, option=option))
        hashes = [0xAAAA, 0xBBBB]
        chunk_descs = [[(10, 4), (14, 4)]]  # chunks need not start on a block boundary
        future_list.append(cc.async_load(hashes=hashes, chunk_descs=chunk_descs, option=option))
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
ok = all(torch.equal(a, b) for a, b in zip(tokens(kv_caches, range(0, 8)), want_1111)) and all(
    torch.equal(a, b) for a, b in zip(tokens(kv_caches, range(10, 18)), want_aaaa))
print(f"loaded KV equals saved KV: {ok}")

# ---------------------------------------------------------------- part 2: layer groups
# A hybrid model: layers 0 and 2 use 4-token blocks, layers 1 and 3 use 16-token
# blocks with another head layout. len(chunk_descs) == len(store_layer_group_desc).
full = [[torch.randn(16, 4, 2, 16, dtype=torch.float16) for _ in ("K", "V")]
        for _ in range(2)]
sliding = [[torch.randn(4, 16, 64, dtype=torch.float16) for _ in ("K", "V")]
           for _ in range(2)]
hybrid = [full[0], sliding[0], full[1], sliding[1]]
store_layer_group_desc = [[0, 2], [1, 3]]
cc.register_kvcache(hybrid, store_layer_group_desc)
hashes = [0x5555, 0x6666]
save_descs = [[(0, 4), (4, 4)], [(0, 16), (16, 16)]]
load_descs = [[(32, 4), (36, 4)], [(32, 16), (48, 16)]]
want = [tokens(full, range(0, 8)), tokens(sliding, range(0, 32))]
print(f"hybrid save: {cc.save(hashes=hashes, chunk_descs=save_descs, option=option)}")
print(f"hybrid load: {cc.load(hashes=hashes, chunk_descs=load_descs, option=option)}")
hybrid_ok = all(torch.equal(a, b) for a, b in zip(tokens(full, range(32, 40)), want[0])) and \
    all(torch.equal(a, b) for a, b in zip(tokens(sliding, range(32, 64)), want[1]))
print(f"hybrid loaded KV equals saved KV: {hybrid_ok}")

Ems.finalize()
exit(0 if ok and hybrid_ok else 3)
