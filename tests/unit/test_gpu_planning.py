"""The GPU data path's planning and ordering, on the CPU (``ems.client.pinning``,
``ems.client.staging``): registration chunks, staging chunks and runs, and the order of
streams, events and copies, driven through the same code as on a GPU with fakes of the
two CUDA Protocols (``ems.client.cuda``); bytes are compared bit for bit against the
host path."""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.client import cuda, pinning
from ems.client.pinning import PinState, plan_chunks
from ems.client.segment import Segment
from ems.client.staging import cut, plan_stages

# ----------------------------------------------------------------- pure plans


@given(size=st.integers(1, 10_000), chunk=st.integers(1, 3_000))
def test_registration_chunks_cover_the_segment_exactly_once(size, chunk):
    chunks = plan_chunks(size, chunk)
    pos = 0
    for c in chunks:
        assert c.offset == pos and 0 < c.nbytes <= chunk
        pos += c.nbytes
    assert pos == size


@given(offset=st.integers(0, 5000), nbytes=st.integers(0, 5000),
       boundary=st.integers(0, 700))
def test_cut_splits_only_at_boundaries(offset, nbytes, boundary):
    pieces = cut(offset, nbytes, boundary)
    assert sum(pieces) == nbytes and all(p > 0 for p in pieces)
    pos = offset
    for p in pieces:
        if boundary:
            assert pos // boundary == (pos + p - 1) // boundary
        pos += p
    if boundary == 0 and nbytes:
        assert pieces == [nbytes]


@st.composite
def layouts(draw):
    """Objects placed in a pool: random sizes, gaps (often none), order shuffled."""
    n = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    offsets, pos = [], 0
    for s in sizes:
        pos += draw(st.sampled_from([0, 0, 64, 7]))
        offsets.append(pos)
        pos += s
    perm = draw(st.permutations(range(n)))
    capacity = max(sizes) + draw(st.integers(0, 900))
    boundary = draw(st.sampled_from([0, 64, 100, 512]))
    objects = [10 + k for k in perm]
    return objects, [offsets[k] for k in perm], [sizes[k] for k in perm], capacity, boundary


@settings(max_examples=300, deadline=None)
@given(case=layouts())
def test_stage_plan_places_every_byte_once(case):
    """Every object is staged once, inside the capacity, and the runs map each of its
    pool bytes to its own staging bytes; no run crosses a registration boundary; two
    objects adjacent in the pool (in one chunk) share one run."""
    objects, offsets, sizes, capacity, boundary = case
    chunks = plan_stages(objects, offsets, sizes, capacity, boundary)
    where = {o: (off, s) for o, off, s in zip(objects, offsets, sizes)}
    seen = []
    for ch in chunks:
        assert ch.nbytes <= capacity
        spans = sorted((so, so + where[o][1]) for o, so in zip(ch.objects, ch.stage_offsets))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        mapping = {}
        for r in ch.runs:
            if boundary:
                assert r.pool_offset // boundary == (r.pool_offset + r.nbytes - 1) // boundary
            for k in range(r.nbytes):
                assert r.pool_offset + k not in mapping
                mapping[r.pool_offset + k] = r.stage_offset + k
        for o, so in zip(ch.objects, ch.stage_offsets):
            off, size = where[o]
            assert [mapping.get(off + k) for k in range(size)] == list(range(so, so + size))
        assert len(mapping) == sum(where[o][1] for o in ch.objects)
        pool_order = sorted(ch.objects, key=lambda o: where[o][0])
        groups = 1 + sum(1 for a, b in zip(pool_order, pool_order[1:])
                         if where[a][0] + where[a][1] != where[b][0])
        if not boundary:
            assert len(ch.runs) == groups
        seen.extend(ch.objects)
    assert sorted(seen) == sorted(objects)


def test_an_object_larger_than_staging_is_refused_by_the_planner():
    with pytest.raises(ValueError):
        plan_stages([0], [0], [100], 99, 0)


# ----------------------------------------------------------------- registration

class FakeRuntime:
    """Records host (un)registrations; checks each is inside a live segment."""

    def __init__(self, refuse_at: int | None = None) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.refuse_at = refuse_at
        self.segments: list[Segment] = []

    def _owner(self, address: int) -> Segment:
        owner = [s for s in self.segments if s.address <= address < s.address + s.size]
        assert owner, f"{address:#x} is not in a segment"
        ctypes.string_at(address, 1)  # still mapped (else this crashes the test run)
        return owner[0]

    def device_of(self, address: int) -> int | None:
        return None

    def host_register(self, device: int, address: int, nbytes: int) -> str | None:
        seg = self._owner(address)
        assert address + nbytes <= seg.address + seg.size  # never past what it owns
        if self.refuse_at is not None and len(self.calls) == self.refuse_at:
            self.calls.append(("refused", address, nbytes))
            return "not permitted"
        self.calls.append(("register", address, nbytes))
        return None

    def host_unregister(self, device: int, address: int) -> None:
        self._owner(address)  # unregistered while still mapped
        self.calls.append(("unregister", address, 0))

    def copy_runs(self, device: int, runs) -> None:
        raise AssertionError("no copies here")


@pytest.fixture
def runtime(monkeypatch):
    def install(**kw) -> FakeRuntime:
        fake = FakeRuntime(**kw)
        monkeypatch.setattr(cuda, "_runtime", fake)
        monkeypatch.setattr(cuda, "_probed", True)
        monkeypatch.setattr(cuda, "_settings", cuda.GpuSettings(register_chunk_bytes=4096))
        return fake
    return install


def new_segment(fake: FakeRuntime, size: int = 5 * 4096 + 100) -> Segment:
    seg = Segment(1, mmap.mmap(-1, size))
    fake.segments.append(seg)
    return seg


def test_a_segment_is_registered_in_chunks_once_and_unregistered_before_unmap(runtime):
    fake = runtime()
    seg = new_segment(fake)
    seg.pin(0)
    seg.pin(0)  # (a second copy: no second registration)
    seg.pinning._thread.join(5)
    assert seg.pinning.state is PinState.REGISTERED
    regs = [(a - seg.address, n) for v, a, n in fake.calls if v == "register"]
    assert regs == [(c.offset, c.nbytes) for c in plan_chunks(seg.size, 4096)]
    seg.close()
    unregs = [a - seg.address for v, a, _ in fake.calls if v == "unregister"]
    assert sorted(unregs) == sorted(off for off, _ in regs)
    assert seg.pinning.state is PinState.RELEASED and not seg.mapped


def test_a_retired_segment_unregisters_after_its_last_copy(runtime):
    """A daemon restart retires the old segment while a copy still uses it: nothing is
    unregistered under the copy; the copy's end unregisters, then unmaps."""
    fake = runtime()
    seg = new_segment(fake)
    seg.pin(0)
    seg.pinning._thread.join(5)
    with seg.use():
        seg.retire()
        assert seg.mapped and not [c for c in fake.calls if c[0] == "unregister"]
    assert not seg.mapped
    assert len([c for c in fake.calls if c[0] == "unregister"]) == 6


def test_a_refusal_leaves_the_rest_pageable_and_unregisters_what_was_done(runtime):
    fake = runtime(refuse_at=2)
    before = pinning.statistics()
    seg = new_segment(fake)
    seg.pin(0)
    seg.pinning._thread.join(5)
    assert seg.pinning.state is PinState.REFUSED
    after = pinning.statistics()
    assert after.refusals == before.refusals + 1
    assert after.pageable_bytes - before.pageable_bytes == seg.size - 2 * 4096
    seg.close()
    assert [v for v, _, _ in fake.calls] == ["register", "register", "refused",
                                             "unregister", "unregister"]


def test_release_while_registering_stops_after_the_current_chunk(runtime):
    fake = runtime()
    gate = __import__("threading").Event()
    real = fake.host_register

    def slow(device, address, nbytes):
        gate.wait(5)
        return real(device, address, nbytes)

    fake.host_register = slow
    seg = new_segment(fake)
    seg.pin(0)
    seg.pinning._stop.set()  # (what release() does first)
    gate.set()
    seg.close()
    regs = [c for c in fake.calls if c[0] == "register"]
    unregs = [c for c in fake.calls if c[0] == "unregister"]
    assert len(regs) <= 1 and len(unregs) == len(regs)


def test_without_cuda_nothing_is_registered(monkeypatch):
    monkeypatch.setattr(cuda, "_runtime", None)
    monkeypatch.setattr(cuda, "_probed", True)
    seg = Segment(1, mmap.mmap(-1, 8192))
    seg.pin(0)
    assert seg.pinning.state is PinState.IDLE
    seg.close()


# ----------------------------------------------------------------- V1 staged path

torch = pytest.importorskip("torch")


class FakeOps:
    """:class:`ems.client.cuda.DeviceOps` on the CPU: streams are names, events numbers;
    work runs at once; every call is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = "engine"
        self._events = 0

    def caller_stream(self, device):
        return "engine"

    def new_stream(self, device):
        return "side"

    def record(self, stream):
        self._events += 1
        self.log.append(("record", stream, self._events))
        return self._events

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    def synchronize(self, event):
        self.log.append(("sync", event))

    @contextlib.contextmanager
    def on(self, stream):
        self.log.append(("on", stream))
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def copy(self, dst, src):
        assert self.current == "side", "a pool copy outside the side stream"
        self.log.append(("copy", int(dst.numel())))
        dst.copy_(src)

    def staging(self, device, nbytes):
        self.log.append(("staging", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def upload(self, host, device):
        assert self.current == "side", "an index upload outside the side stream"
        return host

    def translate(self):
        return contextlib.nullcontext()


def caches(nb=12, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, nb, bs, 3, 8, generator=g)
    return [[base[0], base[1]],  # slices of one [2, nb, bs, h, d] tensor
            [torch.randn(nb, bs, 24, generator=g).half(),
             torch.randint(-100, 100, (bs, nb, 6), generator=g, dtype=torch.int32)
             .permute(1, 0, 2)]]  # dims 0/1 swapped in memory: a token path


class CancelAt:
    """A task whose ``n``-th checkpoint fails (logging it into ``ops``)."""

    def __init__(self, n: int, ops: FakeOps) -> None:
        from ems.futures import Task
        self.task = Task(0, "load")
        self.calls = 0
        real = self.task.checkpoint

        def checkpoint():
            self.calls += 1
            if self.calls >= n:
                ops.log.append(("cancelled",))
                self.task._cancelled = True
            real()

        self.task.checkpoint = checkpoint  # type: ignore[method-assign]


def run(transport, layout, op, slots, offsets, keys, task=None):
    from ems.config import CcKvOption
    from ems.futures import Task
    from ems.keys import Request
    mover = layout.plan_slots(slots, offsets)
    req = Request(op, keys, mover.sizes, mover, CcKvOption())
    task = task or Task(0, op)
    if op == "save":
        return sum(transport.save(req, task))
    return transport.load(req, task)


@pytest.fixture
def pool(monkeypatch):
    from ems.client.embedded import EmbeddedTransport
    monkeypatch.setattr(cuda, "_settings", cuda.GpuSettings(staging_bytes=1 << 20))
    t = EmbeddedTransport(8 << 20)
    yield t
    t.close()


@pytest.mark.parametrize("aligned", [True, False], ids=["block-rows", "token-rows"])
def test_staged_saves_write_the_pool_objects_the_host_path_reads(pool, aligned):
    from ems.client.layout import RegisteredLayout
    kv = caches()
    ref = [[t.clone() for t in layer] for layer in kv]
    ops = FakeOps()
    staged = RegisteredLayout(kv, device_ops=ops)
    host = RegisteredLayout(kv)
    assert host.device_ops is None
    if aligned:
        src, dst, offsets = list(range(0, 12)), list(range(24, 36)), [4, 4, 4]
    else:
        src, dst, offsets = [1, 2, 3, 9, 10], [30, 31, 33, 34, 35], [3, 2]
    keys = [f"k{i}" for i in range(len(offsets))]
    assert run(pool, staged, "save", src, offsets, keys) == len(keys)
    assert ops.log[0] == ("record", "engine", 1)  # the engine's mark, at planning
    first_on = ops.log.index(("on", "side"))
    assert ("wait", "side", 1) in ops.log[:first_on]  # ordered after the engine's writes
    last = max(e for v, *rest in ops.log if v == "record" for _, e in [rest])
    assert ops.log[-1] == ("sync", last)  # nothing in flight after the save returns
    for layer in kv:
        for t in layer:
            t.zero_()
    assert run(pool, host, "load", dst, offsets, keys) == len(keys)
    for layer, rlayer in zip(kv, ref):
        for t, r in zip(layer, rlayer):
            for s, d in zip(src, dst):
                assert torch.equal(t[d // 4, d % 4], r[s // 4, s % 4]), (s, d)


def test_staged_loads_read_what_the_host_path_wrote_and_order_the_engine(pool):
    from ems.client.layout import RegisteredLayout
    kv = caches()
    ref = [[t.clone() for t in layer] for layer in kv]
    host = RegisteredLayout(kv)
    keys = ["a", "b", "c"]
    assert run(pool, host, "save", list(range(12)), [4, 4, 4], keys) == 3
    for layer in kv:
        for t in layer:
            t.zero_()
    ops = FakeOps()
    staged = RegisteredLayout(kv, device_ops=ops)
    assert run(pool, staged, "load", list(range(24, 36)), [4, 4, 4], keys) == 3
    for layer, rlayer in zip(kv, ref):
        for t, r in zip(layer, rlayer):
            assert torch.equal(t[6:9], r[0:3])
            assert not t[:6].any() and not t[9:].any()
    records = [e for v, s, *e in [x for x in ops.log if x[0] == "record"]]
    last = records[-1][0]
    assert ops.log[-2:] == [("sync", last), ("wait", "engine", last)]


def test_chunks_are_bounded_in_flight_and_a_timed_out_load_scatters_nothing_after(
        pool, monkeypatch):
    """Staging that holds one block: one chunk per block. At most two chunks are
    queued ahead; a load whose deadline passes at its third chunk queues nothing
    more, waits for what it queued, and leaves the later blocks untouched."""
    from ems.client.layout import RegisteredLayout
    from ems.futures import Cancelled
    kv = caches()
    host = RegisteredLayout(kv)
    keys = [f"b{i}" for i in range(6)]
    slots = list(range(24))
    assert run(pool, host, "save", slots, [4] * 6, keys) == 6
    ops = FakeOps()
    staged = RegisteredLayout(kv, device_ops=ops)
    one_block = -(-max(staged.plan_slots(list(range(4)), [4]).sizes) // 64) * 64
    monkeypatch.setattr(cuda, "_settings", cuda.GpuSettings(staging_bytes=one_block))
    for layer in kv:
        for t in layer:
            t.zero_()
    cancel = CancelAt(4, ops)
    with pytest.raises(Cancelled):
        run(pool, staged, "load", list(range(24, 48)), [4] * 6, keys, task=cancel.task)
    cut_at = ops.log.index(("cancelled",))
    after = ops.log[cut_at + 1:]
    assert not [x for x in after if x[0] in ("on", "copy")]  # no scatter after it
    chunk_events = [x[2] for x in ops.log if x[0] == "record" and x[1] == "side"]
    assert len(chunk_events) == 3 and after == [("sync", chunk_events[-1])]
    ons = [i for i, x in enumerate(ops.log) if x == ("on", "side")]
    assert ops.log.index(("sync", chunk_events[0])) < ons[2]  # <= 2 chunks queued
    written = [bool(kv[1][0][6 + b].any()) for b in range(6)]
    assert written == [True, True, True, False, False, False]


def test_cpu_tensors_keep_the_host_path_unless_device_ops_are_given():
    from ems.client.layout import RegisteredLayout
    assert RegisteredLayout(caches()).device_ops is None


def test_ordered_after_gives_a_plan_the_engines_mark(pool):
    from ems.client.layout import RegisteredLayout
    ops = FakeOps()
    staged = RegisteredLayout(caches(), device_ops=ops)
    mark = cuda.engine_mark(ops, staged.device)
    with cuda.ordered_after(mark):
        mover = staged.plan_slots(list(range(4)), [4])
    assert mover.mark is mark
    assert staged.plan_slots(list(range(4)), [4]).mark is not mark


def test_a_timed_out_staged_save_waits_for_its_copies_and_gives_the_space_back(pool,
                                                                               monkeypatch):
    from ems.client.layout import RegisteredLayout
    from ems.futures import Cancelled
    kv = caches()
    ops = FakeOps()
    staged = RegisteredLayout(kv, device_ops=ops)
    one_block = -(-max(staged.plan_slots(list(range(4)), [4]).sizes) // 64) * 64
    monkeypatch.setattr(cuda, "_settings", cuda.GpuSettings(staging_bytes=one_block))
    cancel = CancelAt(2, ops)
    with pytest.raises(Cancelled):
        run(pool, staged, "save", list(range(12)), [4, 4, 4], ["x", "y", "z"],
            task=cancel.task)
    after = ops.log[ops.log.index(("cancelled",)) + 1:]
    last = [x[2] for x in ops.log if x[0] == "record" and x[1] == "side"][-1]
    assert after == [("sync", last)]
    stats = pool.statistics()
    assert (stats.used_bytes, stats.reserved, stats.objects) == (0, 0, 0)  # aborted


def test_cuda_runtime_errors_become_io_errors():
    from ems import EmsErrorCode, EmsException
    with pytest.raises(EmsException) as info, cuda._TorchCuda().translate():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert info.value.status_code() is EmsErrorCode.EMS_IO_ERROR
    assert "illegal memory access" in info.value.message()
