"""Device copy paths, tested on CPU with a fake CUDA runtime; real-GPU tests skip cleanly."""

from __future__ import annotations

import ctypes

import pytest

from ems.client import copy as copy_mod


class FakeCuda:
    """Stands in for the CUDA runtime: addresses in ``device`` are "device memory"."""

    def __init__(self, device: set[int]) -> None:
        self.device = device
        self.calls: list[tuple[int, int, int]] = []

    def is_device(self, ptr: int) -> bool:
        return ptr in self.device

    def memcpy(self, dst: int, src: int, n: int) -> None:
        self.calls.append((dst, src, n))
        ctypes.memmove(dst, src, n)  # the fake "device" is host memory


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(device: set[int]) -> FakeCuda:
        fake = FakeCuda(device)
        monkeypatch.setattr(copy_mod, "_cuda", fake)
        monkeypatch.setattr(copy_mod, "_cuda_probed", True)
        return fake
    return install


def test_host_pointers_never_go_through_the_device_runtime(fake_cuda):
    fake = fake_cuda(set())
    src = ctypes.create_string_buffer(b"abcdefgh")
    dst = ctypes.create_string_buffer(8)
    copy_mod.copy_bytes(ctypes.addressof(dst), ctypes.addressof(src), 8)
    assert dst.raw == b"abcdefgh" and fake.calls == []


@pytest.mark.parametrize("side", ["dst", "src"])
def test_device_pointer_is_copied_with_the_runtime(fake_cuda, side):
    src = ctypes.create_string_buffer(b"kvblock!")
    dst = ctypes.create_string_buffer(8)
    s, d = ctypes.addressof(src), ctypes.addressof(dst)
    fake = fake_cuda({d if side == "dst" else s})
    copy_mod.copy_bytes(d, s, 8)
    assert fake.calls == [(d, s, 8)] and dst.raw == b"kvblock!"


def test_v0_save_load_with_device_buffers_uses_the_runtime(fake_cuda, monkeypatch):
    from ems import CcConfig, CcKvOption, Ems, EmsConfig, KvBufferWrapper
    monkeypatch.setenv("EMS_POOL", "embedded")
    src = ctypes.create_string_buffer(bytes(range(64)))
    dst = ctypes.create_string_buffer(64)
    fake = fake_cuda({ctypes.addressof(src), ctypes.addressof(dst)})
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    try:
        cc = Ems.get_cc()
        opt = CcKvOption()
        assert cc.save(opt, ["dev"], [[KvBufferWrapper(ctypes.addressof(src), 64)]]).success == 1
        assert cc.load(opt, ["dev"], [[KvBufferWrapper(ctypes.addressof(dst), 64)]]).success == 1
    finally:
        Ems.finalize()
    assert dst.raw == bytes(range(64))
    assert len(fake.calls) == 2


def test_probe_without_cuda_is_none_or_runtime():
    # On a machine without a GPU the probe answers None and never raises.
    rt = copy_mod.cuda_runtime()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert rt is None


def test_v1_roundtrip_on_cuda_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    from ems import CcConfig_v1, Ems, EmsConfig
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m")))
    try:
        cc = Ems.get_cc()
        kv = [[torch.randn(8, 4, 2, 16, device="cuda") for _ in range(2)] for _ in range(2)]
        ref = [[t.clone() for t in layer] for layer in kv]
        cc.register_kvcache(kv)
        assert cc.save(slot_mapping=list(range(8)), hashes=[1, 2], offsets=[4, 4]).success == 2
        for layer in kv:
            for t in layer:
                t.zero_()
        assert cc.load(slot_mapping=list(range(8, 16)), hashes=[1, 2], offsets=[4, 4]).success == 2
        for layer, rlayer in zip(kv, ref):
            for t, r in zip(layer, rlayer):
                assert torch.equal(t[2:4], r[0:2])
    finally:
        Ems.finalize()


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch-fallback"])
@pytest.mark.parametrize("aligned", [True, False], ids=["block-rows", "token-rows"])
def test_v1_copy_paths_agree(monkeypatch, native_on, aligned):
    """The native bulk copy and the torch gather/scatter (used for device tensors and
    where the extension was not built) move the same bytes."""
    torch = pytest.importorskip("torch")
    from ems import CcConfig_v1, Ems, EmsConfig
    from ems.client import native
    if native_on and not native.available():
        pytest.skip("ems._native was not built")
    monkeypatch.setattr(native, "available", lambda: native_on)
    monkeypatch.setenv("EMS_POOL", "embedded")
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m")))
    try:
        cc = Ems.get_cc()
        g = torch.Generator().manual_seed(0)
        base = torch.randn(2, 10, 4, 3, 8, generator=g)
        kv = [[base[0], base[1]],  # slices of one [2, nb, bs, h, d] tensor
              [torch.randn(10, 4, 24, generator=g).half(),
               torch.randint(-100, 100, (4, 10, 6), generator=g, dtype=torch.int32)
               .permute(1, 0, 2)]]  # dims 0/1 swapped in memory
        ref = [[t.clone() for t in layer] for layer in kv]
        cc.register_kvcache(kv)
        if aligned:
            src, dst, offsets = list(range(0, 8)), list(range(16, 24)), [4, 4]
        else:
            src, dst, offsets = [1, 2, 3, 9, 10], [30, 31, 33, 34, 35], [3, 2]
        assert cc.save(slot_mapping=src, hashes=[5, 6], offsets=offsets).success == 2
        for layer in kv:
            for t in layer:
                t.zero_()
        assert cc.load(slot_mapping=dst, hashes=[5, 6], offsets=offsets).success == 2
        for layer, rlayer in zip(kv, ref):
            for t, r in zip(layer, rlayer):
                flat_t = t.reshape(40, -1) if t.is_contiguous() else None
                for s, d in zip(src, dst):
                    got = t[d // 4, d % 4]
                    want = r[s // 4, s % 4]
                    assert torch.equal(got, want), (s, d)
                if flat_t is not None:
                    untouched = [i for i in range(40) if i not in dst]
                    assert not flat_t[untouched].any()
    finally:
        Ems.finalize()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork with threads (3.12+)
def test_requests_work_in_a_forked_child(monkeypatch):
    """An engine that forks after Ems.init: the child gets worker threads of its own."""
    import os

    import numpy as np

    from ems import CcConfig, CcKvOption, Ems, EmsConfig, KvBufferWrapper
    monkeypatch.setenv("EMS_POOL", "embedded")
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    try:
        cc = Ems.get_cc()
        a = np.arange(256, dtype=np.uint8)
        assert cc.save(CcKvOption(), ["before"], [[KvBufferWrapper(a.ctypes.data, 256)]]).success
        pid = os.fork()
        if pid == 0:  # child: must not hang; exit code says whether it worked
            code = 1
            try:
                b = np.zeros(256, dtype=np.uint8)
                r = cc.load(CcKvOption(timeout=5000), ["before"],
                            [[KvBufferWrapper(b.ctypes.data, 256)]])
                code = 0 if r.success == 1 and (b == a).all() else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        Ems.finalize()
