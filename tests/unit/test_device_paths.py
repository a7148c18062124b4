"""Device copy paths, tested on CPU with a fake CUDA runtime; real-GPU tests skip cleanly."""

from __future__ import annotations

import ctypes

import pytest

from ems.client import cuda


class FakeCuda:
    """Stands in for the CUDA runtime (:class:`ems.client.cuda.CudaRuntime`): addresses
    in ``device`` are "device memory"; it records every call, copies with memmove."""

    def __init__(self, device: set[int], refuse: str | None = None) -> None:
        self.device = device
        self.refuse = refuse
        self.batches: list[list[cuda.Run]] = []
        self.calls: list[tuple[str, int, int]] = []  # (verb, address, bytes)

    def device_of(self, address: int) -> int | None:
        return 0 if address in self.device else None

    def host_register(self, device: int, address: int, nbytes: int) -> str | None:
        self.calls.append(("register", address, nbytes))
        return self.refuse

    def host_unregister(self, device: int, address: int) -> None:
        self.calls.append(("unregister", address, 0))

    def copy_runs(self, device: int, runs) -> None:
        self.batches.append(list(runs))
        for r in runs:
            ctypes.memmove(r.dst, r.src, r.nbytes)  # the fake "device" is host memory


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(device: set[int], refuse: str | None = None) -> FakeCuda:
        fake = FakeCuda(device, refuse)
        monkeypatch.setattr(cuda, "_runtime", fake)
        monkeypatch.setattr(cuda, "_probed", True)
        return fake
    return install


def _v0(monkeypatch, **env: str):
    from ems import CcConfig, Ems, EmsConfig
    monkeypatch.setenv("EMS_POOL", "embedded")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    return Ems


def test_host_pointers_never_go_through_the_device_runtime(fake_cuda, monkeypatch):
    from ems import CcKvOption, KvBufferWrapper
    fake = fake_cuda(set())
    src = ctypes.create_string_buffer(b"abcdefgh")
    dst = ctypes.create_string_buffer(8)
    ems = _v0(monkeypatch)
    try:
        cc = ems.get_cc()
        assert cc.save(CcKvOption(), ["h"], [[KvBufferWrapper(ctypes.addressof(src), 8)]]
                       ).success == 1
        assert cc.load(CcKvOption(), ["h"], [[KvBufferWrapper(ctypes.addressof(dst), 8)]]
                       ).success == 1
    finally:
        ems.finalize()
    assert dst.raw == b"abcdefgh"
    assert fake.batches == [] and fake.calls == []  # nothing registered either


def test_v0_device_buffers_move_in_one_batched_call_per_request(fake_cuda, monkeypatch):
    """Three keys of two device buffers each: one ``copy_runs`` per save and per load
    (not a synchronous copy per buffer); the pool registered once, in the background,
    and unregistered before the embedded arena is unmapped."""
    from ems import CcKvOption, KvBufferWrapper
    bufs = [ctypes.create_string_buffer(bytes([k]) * 48) for k in range(6)]
    outs = [ctypes.create_string_buffer(48) for _ in range(6)]
    fake = fake_cuda({ctypes.addressof(b) for b in bufs + outs})
    ems = _v0(monkeypatch)
    try:
        cc = ems.get_cc()
        seg = ems._transport.segment
        keys = ["a", "b", "c"]
        regions = [[KvBufferWrapper(ctypes.addressof(bufs[2 * i + j]), 48) for j in (0, 1)]
                   for i in range(3)]
        assert cc.save(CcKvOption(), keys, regions).success == 3
        outr = [[KvBufferWrapper(ctypes.addressof(outs[2 * i + j]), 48) for j in (0, 1)]
                for i in range(3)]
        assert cc.load(CcKvOption(), keys, outr).success == 3
        assert len(fake.batches) == 2 and [len(b) for b in fake.batches] == [6, 6]
        seg.pinning._thread.join(5)
        assert seg.pinning.state.value == "registered"
    finally:
        ems.finalize()
    assert [o.raw[:48] for o in outs] == [b.raw[:48] for b in bufs]
    regs = [c for c in fake.calls if c[0] == "register"]
    unregs = [c for c in fake.calls if c[0] == "unregister"]
    assert sum(n for _, _, n in regs) == seg.size  # the whole arena, once
    assert sorted(a for _, a, _ in unregs) == sorted(a for _, a, _ in regs)


def test_v0_device_runs_are_cut_at_registration_chunks(fake_cuda, monkeypatch):
    from ems import CcKvOption, KvBufferWrapper
    monkeypatch.setattr(cuda, "_settings", cuda.GpuSettings(register_chunk_bytes=4096))
    buf = ctypes.create_string_buffer(bytes(range(256)) * 40)  # 10240 bytes
    out = ctypes.create_string_buffer(10240)
    fake = fake_cuda({ctypes.addressof(buf), ctypes.addressof(out)})
    monkeypatch.setattr(cuda, "configure", lambda value: None)  # keep the small chunks
    ems = _v0(monkeypatch)
    try:
        cc = ems.get_cc()
        seg = ems._transport.segment
        base = seg.address
        assert cc.save(CcKvOption(), ["k"], [[KvBufferWrapper(ctypes.addressof(buf), 10240)]]
                       ).success == 1
        assert cc.load(CcKvOption(), ["k"], [[KvBufferWrapper(ctypes.addressof(out), 10240)]]
                       ).success == 1
    finally:
        ems.finalize()
    assert out.raw[:10240] == buf.raw[:10240]
    for batch in fake.batches:
        assert sum(r.nbytes for r in batch) == 10240
        for r in batch:
            pool = r.dst if base <= r.dst < base + seg.size else r.src
            first, last = (pool - base) // 4096, (pool - base + r.nbytes - 1) // 4096
            assert first == last, "a run spans two registration chunks"


def test_a_refused_registration_is_logged_once_counted_and_copies_still_work(
        fake_cuda, monkeypatch, caplog):
    from ems import CcKvOption, KvBufferWrapper
    from ems.client import pinning
    buf = ctypes.create_string_buffer(b"x" * 64)
    fake = fake_cuda({ctypes.addressof(buf)}, refuse="operation not permitted (code 800)")
    before = pinning.statistics()
    ems = _v0(monkeypatch)
    try:
        cc = ems.get_cc()
        seg = ems._transport.segment
        with caplog.at_level("WARNING", logger="ems.client.pinning"):
            assert cc.save(CcKvOption(), ["k"], [[KvBufferWrapper(ctypes.addressof(buf), 64)]]
                           ).success == 1
            seg.pinning._thread.join(5)
        assert seg.pinning.state.value == "refused"
        assert cc.load(CcKvOption(), ["k"], [[KvBufferWrapper(ctypes.addressof(buf), 64)]]
                       ).success == 1
    finally:
        ems.finalize()
    after = pinning.statistics()
    assert after.refusals == before.refusals + 1
    assert after.pageable_bytes - before.pageable_bytes == seg.size
    assert [c[0] for c in fake.calls] == ["register"]  # nothing to unregister
    assert len([r for r in caplog.records if "cudaHostRegister refused" in r.message]) <= 1


def test_registration_off_never_registers(fake_cuda, monkeypatch):
    from ems import CcKvOption, KvBufferWrapper
    buf = ctypes.create_string_buffer(b"y" * 64)
    fake = fake_cuda({ctypes.addressof(buf)})
    ems = _v0(monkeypatch, EMS_CUDA_REGISTER="0")
    try:
        cc = ems.get_cc()
        assert cc.save(CcKvOption(), ["k"], [[KvBufferWrapper(ctypes.addressof(buf), 64)]]
                       ).success == 1
    finally:
        ems.finalize()
        cuda.configure(cuda.GpuSettings())
    assert fake.calls == [] and len(fake.batches) == 1


def test_probe_without_cuda_is_none_or_runtime():
    # On a machine without a GPU the probe answers None and never raises.
    rt = cuda.runtime()
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


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    return torch


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_v1_staged_chunks_on_cuda_are_bit_exact_and_register_the_pool(monkeypatch, dtype):
    """Real CUDA: staging smaller than the request (several chunks), bit-exact both
    ways, and the embedded arena registered (or refused, counted) in the background."""
    torch = _cuda_torch()
    from ems import CcConfig_v1, Ems, EmsConfig
    monkeypatch.setenv("EMS_POOL", "embedded")
    monkeypatch.setenv("EMS_CAPACITY", "256M")
    monkeypatch.setenv("EMS_CUDA_STAGING", "1M")
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m")))
    try:
        cc = Ems.get_cc()
        dt = getattr(torch, dtype)
        kv = [[torch.randn(64, 16, 8, 128, device="cuda").to(dt) for _ in range(2)]
              for _ in range(4)]
        ref = [[t.clone() for t in layer] for layer in kv]
        cc.register_kvcache(kv)
        n = 24  # 24 blocks x 4 layers x 2 x 32 KiB = 6 MiB: 6+ chunks of 1 MiB
        assert cc.save(slot_mapping=list(range(16 * n)), hashes=list(range(n)),
                       offsets=[16] * n).success == n
        for layer in kv:
            for t in layer:
                t.zero_()
        dst = list(range(16 * 32, 16 * (32 + n)))
        assert cc.load(slot_mapping=dst, hashes=list(range(n)), offsets=[16] * n
                       ).success == n
        torch.cuda.current_stream().synchronize()
        for layer, rlayer in zip(kv, ref):
            for t, r in zip(layer, rlayer):
                assert torch.equal(t[32:32 + n].view(torch.uint8), r[:n].view(torch.uint8))
                assert not t[:32].view(torch.uint8).any()
        seg = Ems._transport.segment
        seg.pinning._thread.join(60)
        assert seg.pinning.state.value in ("registered", "refused")
    finally:
        Ems.finalize()


@pytest.mark.torch
def test_v0_cuda_buffers_round_trip_in_batches(monkeypatch):
    torch = _cuda_torch()
    from ems import CcConfig, CcKvOption, Ems, EmsConfig, KvBufferWrapper
    monkeypatch.setenv("EMS_POOL", "embedded")
    monkeypatch.setenv("EMS_CAPACITY", "64M")
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    try:
        cc = Ems.get_cc()
        src = torch.randint(0, 256, (8, 2, 65536), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        keys = [f"k{i}" for i in range(8)]
        def bufs(t):
            return [[KvBufferWrapper(t[i, j].data_ptr(), t[i, j].numel()) for j in (0, 1)]
                    for i in range(8)]
        torch.cuda.synchronize()
        assert cc.save(CcKvOption(), keys, bufs(src)).success == 8
        assert cc.load(CcKvOption(), keys, bufs(dst)).success == 8
        assert torch.equal(src, dst)
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
