"""Test harness only: import-time patches that let SGLang's HiCache run on a CPU torch.

On ``PYTHONPATH`` of the engine processes the tests start (never in ``src/``), active
only with ``SGLANG_USE_CPU_ENGINE=1``. Three spots of SGLang's host pool are CUDA-only:

* ``pool_host.common`` allocates with ``cudaHostRegister``: a plain allocation here;
* ``pool_host.base`` pins its memory: not on a CPU torch;
* ``pool_host.mha`` binds its device<->host copies to ``sgl_kernel`` only on CUDA /
  HIP / XPU: the pure-torch equivalents below (gathers and scatters of token rows);
* ``torch.cpu.Stream`` has no ``synchronize``.

Each patch runs right after its module is first imported (a meta-path hook), so
site-packages stay untouched.
"""

import importlib.abc
import importlib.machinery
import os
import sys


def _long(t):
    import torch

    return t.to(device="cpu", dtype=torch.int64)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    si, di = _long(src_indices), _long(dst_indices)
    for src, dst in zip(src_layers, dst_layers):
        dst[di] = src[si]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices,
                                       layer_id, page_size):
    # host page_first_direct [page, layer, page_size, H, D] -> device layer [token, H, D]
    si, di = _long(src_indices), _long(dst_indices)
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[di] = src[si // page_size, layer_id, si % page_size]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices,
                                       page_size):
    # device layers [K_0..K_{L-1}, V_0..V_{L-1}] -> host [k, v] page_first_direct
    si, di = _long(src_indices), _long(dst_indices)
    layers = len(src_ptrs) // 2
    for c, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[di // page_size, layer, di % page_size] = src_ptrs[c * layers + layer][si]


def _patch_common(m):
    def alloc_cpu(dims, dtype, device, pin_memory, allocator,
                  registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    m.ALLOC_MEMORY_FUNCS["cpu"] = alloc_cpu


def _patch_mha(m):
    m.transfer_kv_direct = transfer_kv_direct
    m.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    m.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf


def _patch_base(m):
    init = m.HostKVCache.__init__

    def unpinned_init(self, *args, **kwargs):
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    m.HostKVCache.__init__ = unpinned_init


def _patch_stream(m):
    import torch

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None


PATCHES = {
    "sglang.srt.mem_cache.pool_host.base": _patch_base,
    "sglang.srt.mem_cache.pool_host.common": _patch_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
    "sglang.srt.mem_cache.l2_transfer": _patch_stream,
}


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, _run=run, _name=name):
            _run(module)
            PATCHES[_name](module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _PatchFinder())
