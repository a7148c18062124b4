"""V1: the registered paged KV cache, and the vectorised mover between it and the pool.

``register_kvcache(kv_caches, store_layer_group_desc=None)`` takes, per layer, any
number of tensors (K and V; MLA ``[nope, pe]``; mixed dtypes), each 3-D or 4-D with
dimension 0 the block index and dimension 1 the position in the block:
``[num_blocks, block_size, ...]``. A token's slot is ``block * block_size + pos``.
The trailing dimensions of one token must be contiguous; dims 0 and 1 may have any
strides (slices of a larger cache work).

Layer groups (``store_layer_group_desc``) exist for hybrid models whose layers have
different cache layouts: a ``list[list[int]]`` of layer indices, every registered
layer in exactly one group (default: one group of all layers). All tensors of a group
share ``num_blocks`` and ``block_size``. In the chunk_descs semantics, chunk ``i`` of
group ``g`` is the slots ``[start, start + length)`` of that group's tensors; in the
slot_mapping semantics the same slots apply to every group.

The pool object of block ``i`` is, for each group, for each layer of the group, for
each of its tensors, the ``n`` token rows of that tensor (``n`` = the block's token
count in that group), concatenated. Its key includes a fingerprint of the layout
(group structure, block sizes, per-token shapes and dtypes; not ``num_blocks``), so a
load never copies bytes saved under another layout, while a restarted instance with
the same layout hits its old blocks.

Copies are vectorised, never a Python loop over blocks or tokens. Host tensors (with
the native helper built): every run of the request (a whole block where every block
of a group is a full, block-aligned run of slots, as engines send; else a token) is
computed at once from per-group int64 tables, sorted by source address, and copied
by the native helper a few calls per request (``_copy_runs``). A cache on one CUDA
device: its blocks are gathered on the GPU into a staging buffer laid out as the pool
objects, which moves in one asynchronous copy per contiguous pool run on a side
stream, ordered by events against the engine's stream (:mod:`ems.client.staging`;
never a device-wide synchronize). Other devices and builds without the helper: per
registered tensor, one gather (``index_select``) and one scatter (``index_put_`` /
``index_copy_``). Pool memory and staging are viewed as overlapping rows
(:meth:`Segment.window`) so that a row index is an element offset and one index op
reaches objects anywhere.

Opaque pages (``block_size=N``): some layouts do not keep a block's tokens along dim
1 -- the NZ layout ``[num_blocks, heads*head_size/16, block_size, 16]``, vLLM's CPU
layout ``[num_blocks, kv_heads, 2*block_size, head_size]`` (a block's K rows, then
its V rows). Clients of those layouts move whole blocks only. Registering with
``block_size=N`` (an int for every group, or one entry per group, None = paged) says
so: every tensor's ``t[block_id]`` (dims 1.. contiguous, any shape, 2-D or more) is an
opaque page of ``N`` tokens, a block's object is its pages concatenated, and a call
must name exactly one whole, block-aligned block per hash (``offsets[i] == N``, slots
``b*N .. b*N+N-1``); a token inside a block is ``EMS_INVALID_ARGUMENT`` saying why.
The layout is never guessed from shapes: ``[nb, kv_heads, 2*bs, hs]`` with
``kv_heads == bs`` would look paged, and a partial block would then move wrong bytes.

Meta tensors (``device="meta"``) register a layout without memory: the keys and
``exists`` work (a scheduler process that holds no KV tensors computes the same keys
as its workers: ``num_blocks`` is not part of a key), save and load raise
``EMS_INVALID_ARGUMENT``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from types import ModuleType
from typing import TYPE_CHECKING, Optional, Sequence

from ems.client import cuda, native, staging
from ems.client.segment import Segment
from ems.errors import invalid
from ems.futures import Task

if TYPE_CHECKING:  # the SDK imports without torch: torch is imported where a layout is
    import torch
    from torch import Tensor

    #: one group's tokens selected for a copy: (slots, token's object, token's position
    #: in it, objects of the whole-block path)
    _Selection = tuple[Tensor, Tensor, Tensor, Tensor]
    #: runs of bytes for the native copy: (pool address, cache address, length) tables
    _Runs = tuple[Tensor, Tensor, Tensor]

__all__ = ["RegisteredLayout", "V1Mover"]

#: bytes per native copy call of a V1 request: a deadline is checked between calls
#: (~1 ms apart at the ~15-20 GB/s of the copy), the calls themselves cost ~2 us each
_CHUNK = 16 << 20


@dataclasses.dataclass
class _TensorInfo:
    group: int
    layer: int
    t3: Tensor  # [num_blocks, block_size, E] in the layout's unit dtype
    #: [num_blocks * block_size, E] view, or None when dims 0/1 don't merge
    rows: Optional[Tensor]
    #: [num_blocks, block_size * E] view, or None when a block isn't contiguous
    blocks: Optional[Tensor]
    token_bytes: int
    width: int  # E: units per token
    ptr: int  # address of block 0, position 0
    stride0: int  # bytes between blocks
    stride1: int  # bytes between positions
    host: bool  # on the CPU: the native bulk copy may address it directly
    page_bytes: int = 0  # > 0: an opaque page of this many bytes per block


@dataclasses.dataclass
class _Group:
    layers: list[int]
    num_blocks: int
    block_size: int
    tensors: list[int]  # indices into RegisteredLayout.tensors
    opaque: bool = False  # every tensor's t[block] is an opaque page (block_size given)

    @property
    def slots(self) -> int:
        return self.num_blocks * self.block_size


class _HostRuns:
    """One group's host tensors as int64 columns, so that the runs of every tensor of
    the group are computed by a few broadcast ops (a row per block or token, a column
    per tensor) instead of a few ops per tensor: at 64 tensors (32 layers x K, V) the
    per-tensor ops cost ~1 ms of Python per call, an eighth of a 128 MiB copy.

    ``whole``: the columns whose block is one run of bytes (dims 0/1 of the block
    contiguous, or an opaque page), moved a block at a time when the request's blocks
    are full and aligned; ``rest``: the others, moved a token at a time (each a
    :class:`_Columns`, or None when no column is of that kind)."""

    def __init__(self, torch: ModuleType, tensors: list[_TensorInfo], group: _Group) -> None:
        mine = [tensors[i] for i in group.tensors]
        self.host = bool(mine) and all(t.host for t in mine)
        run = [t.page_bytes or (t.token_bytes * group.block_size
                                if t.stride1 == t.token_bytes else 0) for t in mine]
        self.all = _Columns(torch, group.tensors, mine, run)
        whole = [k for k, n in enumerate(run) if n]
        rest = [k for k, n in enumerate(run) if not n]
        self.whole = self.all.pick(torch, whole) if whole else None
        self.rest = self.all.pick(torch, rest) if rest else None


class _Columns:
    """Per tensor (a column): its index in the layout, address of block 0, strides,
    token bytes and block run bytes (0: a block is not one run)."""

    def __init__(self, torch: ModuleType, index: list[int], infos: list[_TensorInfo],
                 run: list[int]) -> None:
        col = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        self.index = col(index)
        self.ptr = col([t.ptr for t in infos])
        self.stride0 = col([t.stride0 for t in infos])
        self.stride1 = col([t.stride1 for t in infos])
        self.token_bytes = col([t.token_bytes for t in infos])
        self.block_bytes = col(run)
        self._lists = (index, infos, run)

    def pick(self, torch: ModuleType, ks: list[int]) -> "_Columns":
        index, infos, run = self._lists
        return _Columns(torch, [index[k] for k in ks], [infos[k] for k in ks],
                        [run[k] for k in ks])


def _units(torch: ModuleType) -> list[tuple[int, torch.dtype]]:
    return [(8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)]


class RegisteredLayout:
    """What ``register_kvcache`` registered: validated views of every cache tensor."""

    def __init__(self, kv_caches: object, store_layer_group_desc: object = None,
                 block_size: object = None, device_ops: Optional[cuda.DeviceOps] = None
                 ) -> None:
        import torch
        self._torch = torch
        if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
            raise invalid("kv_caches must be a non-empty list (one entry per layer)")
        given: list[list[object]] = []
        for li, layer in enumerate(kv_caches):
            if isinstance(layer, torch.Tensor) or not isinstance(layer, (list, tuple)) \
                    or not layer:
                raise invalid(f"kv_caches[{li}] must be a non-empty list of tensors")
            given.append(list(layer))
        self.groups = self._groups(given, store_layer_group_desc, block_size)
        checked: dict[int, list[Tensor]] = {}
        for group in self.groups:
            for li in group.layers:
                checked[li] = [self._check_tensor(t, f"kv_caches[{li}][{ti}]", group.opaque)
                               for ti, t in enumerate(given[li])]
        layers = [checked[li] for li in range(len(given))]  # (every layer is in a group)
        # One copy unit for the whole layout: the largest that divides every token
        # row, every stride and every address (pool offsets are 64-byte aligned).
        unit, self.dtype = 1, torch.uint8
        for size, dtype in _units(torch):
            if all(self._fits(t, size) for layer in layers for t in layer):
                unit, self.dtype = size, dtype
                break
        self.unit = unit
        self.tensors: list[_TensorInfo] = []
        for gi, group in enumerate(self.groups):
            for li in group.layers:
                for t in layers[li]:
                    group.tensors.append(len(self.tensors))
                    self.tensors.append(self._info(t, gi, li))
        #: per group, the table the native copy computes its runs from (None: not on
        #: the host, so moved by torch)
        self.host_runs = [_HostRuns(torch, self.tensors, g) for g in self.groups]
        #: per tensor, bytes of one token's row (0 for an opaque page) and of its page
        self.row_bytes = torch.tensor([0 if t.page_bytes else t.token_bytes
                                       for t in self.tensors], dtype=torch.int64)
        self.page_bytes = torch.tensor([t.page_bytes for t in self.tensors],
                                       dtype=torch.int64)
        #: per tensor, its layer group
        self.tensor_group = torch.tensor([t.group for t in self.tensors], dtype=torch.int64)
        desc: list[object] = []
        for g in self.groups:
            if g.opaque:  # the whole page's shape: its inner order is the layout's own
                desc.append(("opaque", g.layers, g.block_size,
                             [(str(layers[li][k].dtype), tuple(layers[li][k].shape[1:]))
                              for li in g.layers for k in range(len(layers[li]))]))
            else:  # (unchanged since the first release: old blocks keep their keys)
                desc.append((g.layers, g.block_size,
                             [(str(layers[li][k].dtype), tuple(layers[li][k].shape[2:]))
                              for li in g.layers for k in range(len(layers[li]))]))
        self.fingerprint = hashlib.blake2b(repr(desc).encode(), digest_size=8).hexdigest()
        self.devices = sorted({str(layers[li][0].device) for li in range(len(layers))})
        #: a layout without memory (meta tensors): keys and exists only
        self.meta = self.devices == ["meta"]
        if "meta" in self.devices and not self.meta:
            raise invalid(f"kv_caches mixes meta tensors with tensors on {self.devices}: "
                          f"register either a layout only (all meta) or real memory")
        #: the staged device path (:mod:`ems.client.staging`) of a cache on one CUDA
        #: device, with its device (None: host tables or torch gather/scatter).
        #: ``device_ops`` given: that path on any device (tests drive it on the CPU).
        self.device_ops: Optional[cuda.DeviceOps] = device_ops
        self.device: torch.device = layers[0][0].device
        on_cuda = len(self.devices) == 1 and self.device.type == "cuda"
        if device_ops is None and on_cuda:
            self.device_ops = cuda.torch_ops()

    # ------------------------------------------------------------ registration
    def _check_tensor(self, t: object, field: str, opaque: bool = False) -> Tensor:
        """``t``, checked to be a cache tensor of the layout (``EMS_INVALID_ARGUMENT``)."""
        torch = self._torch
        if not isinstance(t, torch.Tensor):
            raise invalid(f"{field} must be a torch.Tensor, got {type(t).__name__}")
        if t.numel() == 0:
            raise invalid(f"{field} must not be empty, got shape {tuple(t.shape)}")
        shape, stride = t.shape, t.stride()
        if opaque:
            if t.dim() < 2:
                raise invalid(f"{field} must be at least 2-D [num_blocks, ...] (an opaque "
                              f"page per block), got shape {tuple(shape)}")
            first, what = 1, "the page dims (all but dim 0)"
        else:
            if t.dim() not in (3, 4):
                raise invalid(f"{field} must be 3-D or 4-D [num_blocks, block_size, ...], "
                              f"got shape {tuple(shape)} (register other layouts, whose "
                              f"blocks are opaque pages, with block_size=N)")
            first, what = 2, f"the per-token dims {tuple(shape[2:])}"
        expect = 1
        for d in range(t.dim() - 1, first - 1, -1):
            if shape[d] != 1 and stride[d] != expect:
                raise invalid(f"{field}: {what} must be contiguous, got strides "
                              f"{tuple(stride)}")
            expect *= shape[d]
        return t

    @staticmethod
    def _fits(t: Tensor, unit: int) -> bool:
        es = t.element_size()
        if t.dim() < 3:  # (only opaque pages are 2-D: their row is the page)
            tb, strides = es * int(t[0].numel()), t.stride()[:1]
        else:
            tb, strides = es * int(t[0, 0].numel()), t.stride()[:2]
        return (tb % unit == 0 and t.data_ptr() % unit == 0
                and all((s * es) % unit == 0 for s in strides))

    def _groups(self, layers: list[list[object]], desc: object, block_size: object
                ) -> list[_Group]:
        n = len(layers)
        if desc is None:
            desc = [list(range(n))]
        if not isinstance(desc, (list, tuple)) or not desc:
            raise invalid("store_layer_group_desc must be a non-empty list of layer-index "
                          "lists, e.g. [[0, 1, 2], [3]]")
        seen: set[int] = set()
        groups = []
        for gi, members in enumerate(desc):
            field = f"store_layer_group_desc[{gi}]"
            if not isinstance(members, (list, tuple)) or not members:
                raise invalid(f"{field} must be a non-empty list of layer indices")
            for li in members:
                if isinstance(li, bool) or not isinstance(li, int) or not 0 <= li < n:
                    raise invalid(f"{field} holds {li!r}: layer indices must be ints in "
                                  f"[0, {n})")
                if li in seen:
                    raise invalid(f"{field}: layer {li} is in more than one group")
                seen.add(li)
            page_bs = self._page_block_size(block_size, gi, len(desc))
            first = layers[members[0]][0]
            if not isinstance(first, self._torch.Tensor) or first.dim() < 2:
                raise invalid(f"kv_caches[{members[0]}][0] must be a torch.Tensor of at "
                              f"least 2 dims, got {getattr(first, 'shape', type(first))}")
            nb = int(first.shape[0])
            bs = page_bs if page_bs is not None else int(first.shape[1])
            for li in members:
                for ti, t in enumerate(layers[li]):
                    if not isinstance(t, self._torch.Tensor) or t.dim() < 2:
                        continue  # _check_tensor names it
                    mine = (int(t.shape[0]), bs if page_bs is not None else int(t.shape[1]))
                    if mine != (nb, bs):
                        what = "num_blocks" if page_bs is not None else \
                            "[num_blocks, block_size]"
                        got = mine[0] if page_bs is not None else list(t.shape[:2])
                        want = nb if page_bs is not None else [nb, bs]
                        raise invalid(
                            f"kv_caches[{li}][{ti}] has {what} = {got}, but its group "
                            f"{gi} uses {want}: tensors of one layer group must share it")
                    if t.device != first.device:
                        raise invalid(f"kv_caches[{li}][{ti}] is on {t.device}, but its "
                                      f"group {gi} is on {first.device}")
            groups.append(_Group(list(members), nb, bs, [], opaque=page_bs is not None))
        if len(seen) != n:
            missing = sorted(set(range(n)) - seen)
            raise invalid(f"store_layer_group_desc must place every layer in a group; "
                          f"missing {missing}")
        return groups

    @staticmethod
    def _page_block_size(block_size: object, gi: int, n_groups: int) -> Optional[int]:
        """Group ``gi``'s opaque-page block size (None: paged) from ``block_size``."""
        if block_size is None:
            return None
        if isinstance(block_size, (list, tuple)):
            if len(block_size) != n_groups:
                raise invalid(f"block_size must be an int or one entry per layer group "
                              f"({n_groups}), got {len(block_size)} entries")
            value, field = block_size[gi], f"block_size[{gi}]"
            if value is None:
                return None
        else:
            value, field = block_size, "block_size"
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise invalid(f"{field} must be an int > 0 (tokens per block), got {value!r}")
        return value

    def _info(self, t: Tensor, gi: int, li: int) -> _TensorInfo:
        if self.groups[gi].opaque:
            return self._page_info(t, gi, li)
        nb, bs = int(t.shape[0]), int(t.shape[1])
        elems = int(t[0, 0].numel())
        s0, s1 = t.stride()[:2]
        t3 = t.as_strided((nb, bs, elems), (s0, s1, 1)).view(self._torch.uint8)
        t3 = t3.view(self.dtype)
        width = int(t3.shape[2])
        u0, u1 = t3.stride()[:2]
        rows = t3.as_strided((nb * bs, width), (u1, 1)) if u0 == bs * u1 else None
        blocks = t3.as_strided((nb, bs * width), (u0, 1)) if u1 == width else None
        es = t.element_size()
        return _TensorInfo(gi, li, t3, rows, blocks, elems * es, width, t.data_ptr(),
                           s0 * es, s1 * es, t.device.type == "cpu")

    def _page_info(self, t: Tensor, gi: int, li: int) -> _TensorInfo:
        """An opaque page per block: one row of ``[num_blocks, page units]``."""
        nb = int(t.shape[0])
        elems = int(t[0].numel())
        es = t.element_size()
        s0 = t.stride()[0]
        pages = t.as_strided((nb, elems), (s0, 1)).view(self._torch.uint8).view(self.dtype)
        width = int(pages.shape[1])
        t3 = pages.view(nb, 1, width)
        return _TensorInfo(gi, li, t3, None, pages, elems * es, width, t.data_ptr(),
                           s0 * es, elems * es, t.device.type == "cpu",
                           page_bytes=elems * es)

    # ------------------------------------------------------------ planning
    def slot_sizes(self, offsets: Sequence[int]) -> list[int]:
        """Object sizes of blocks of these token counts in the slot_mapping semantics
        (the same as ``plan_slots(...).sizes``, without planning any copy)."""
        self._check_pages(offsets, "offsets")
        row_bytes = sum(t.token_bytes for t in self.tensors if not t.page_bytes)
        page_bytes = sum(t.page_bytes for t in self.tensors)
        return [n * row_bytes + page_bytes for n in offsets]

    def _check_pages(self, counts: Sequence[int], field: str) -> None:
        """Opaque groups move one whole block per hash (see the module docstring)."""
        for gi, group in enumerate(self.groups):
            if group.opaque:
                bad = next((i for i, n in enumerate(counts) if n != group.block_size), None)
                if bad is not None:
                    raise invalid(
                        f"{field}[{bad}] = {counts[bad]}: layer group {gi} is registered "
                        f"as opaque pages (block_size={group.block_size}), so each hash "
                        f"must name exactly one whole block of {group.block_size} tokens; "
                        f"a token inside a block of such a layout cannot be addressed")

    def plan_slots(self, slots: list[int], offsets: list[int]) -> "V1Mover":
        torch = self._torch
        self._check_pages(offsets, "offsets")
        slot_t = torch.tensor(slots, dtype=torch.int64)
        counts = torch.tensor(offsets, dtype=torch.int64)
        lo, hi = int(slot_t.min()), int(slot_t.max())
        cap = min(g.slots for g in self.groups)
        if lo < 0 or hi >= cap:
            bad = lo if lo < 0 else hi
            raise invalid(f"slot_mapping holds slot {bad}: slots must be in [0, {cap}) "
                          f"(num_blocks * block_size of the registered cache)")
        return V1Mover(self, [(slot_t, counts)] * len(self.groups))

    def plan_chunks(self, chunk_descs: list[list[tuple[int, int]]]) -> "V1Mover":
        torch = self._torch
        per_group = []
        for gi, (group, chunks) in enumerate(zip(self.groups, chunk_descs)):
            if group.opaque:
                bad = next((i for i, c in enumerate(chunks) if c[1] != group.block_size),
                           None)
                if bad is not None:
                    raise invalid(
                        f"chunk_descs[{gi}][{bad}] = {tuple(chunks[bad])}: layer group {gi} "
                        f"is registered as opaque pages (block_size={group.block_size}), so "
                        f"each chunk must be exactly one whole block")
            desc = torch.tensor(chunks, dtype=torch.int64)
            starts, lengths = desc[:, 0], desc[:, 1]
            ends = starts + lengths
            if int(ends.max()) > group.slots:
                i = int(torch.argmax((ends > group.slots).to(torch.int8)))
                raise invalid(f"chunk_descs[{gi}][{i}] = {tuple(chunks[i])} ends past slot "
                              f"{group.slots} (num_blocks * block_size of group {gi})")
            owner, pos = _spread(torch, lengths)
            per_group.append((starts.index_select(0, owner) + pos, lengths))
        return V1Mover(self, per_group)


def _spread(torch: ModuleType, counts: Tensor) -> tuple[Tensor, Tensor]:
    """For ``counts[i]`` tokens of object ``i``, in order: each token's object and its
    position in that object. (``repeat_interleave`` and ``searchsorted`` compute the
    same, but run on torch's intra-op threads from a few dozen elements on: on a busy
    2-vCPU host a V1 call then waited milliseconds for a preempted worker, and the
    worker's spinning took as much CPU as the call; a step at each object's end,
    summed up, is single-threaded at this size.)"""
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if ends.numel() else 0
    step = torch.zeros(total + 1, dtype=torch.int64)
    if ends.numel() > 1:  # the next object starts where one ends (empty ones: twice)
        step.index_add_(0, ends[:-1], torch.ones(ends.numel() - 1, dtype=torch.int64))
    owner = torch.cumsum(step[:total], 0)
    return owner, torch.arange(total) - (ends - counts).index_select(0, owner)


class _Tokens:
    """The tokens of one group in one request, and the fast-path block ids."""

    def __init__(self, torch: ModuleType, slots: Tensor, counts: Tensor, block_size: int
                 ) -> None:
        n_obj = counts.numel()
        self.slots = slots
        self.counts = counts
        self.obj, self.pos = _spread(torch, counts)
        self.block_ids: Optional[Tensor] = None
        if bool((counts == block_size).all()):
            grid = slots.view(n_obj, block_size)
            first = grid[:, 0]
            if bool((first % block_size == 0).all()) and bool(
                    (grid == first[:, None] + torch.arange(block_size)).all()):
                self.block_ids = first // block_size


class V1Mover:
    """Moves the blocks of one V1 request (see the module docstring for the layout)."""

    def __init__(self, layout: RegisteredLayout, per_group: Sequence[tuple[Tensor, Tensor]]
                 ) -> None:
        torch = layout._torch
        self.layout = layout
        self._torch = torch
        cache: dict[int, _Tokens] = {}
        self.tokens: list[_Tokens] = []
        for group, (slots, counts) in zip(layout.groups, per_group):
            key = id(slots)
            if key not in cache:  # slot_mapping: every group shares one token list
                cache[key] = _Tokens(torch, slots, counts, group.block_size)
            self.tokens.append(cache[key])
        for gi, (group, tok) in enumerate(zip(layout.groups, self.tokens)):
            if group.opaque and tok.block_ids is None:
                raise invalid(
                    f"layer group {gi} is registered as opaque pages (block_size="
                    f"{group.block_size}): each hash must name one whole, block-aligned "
                    f"block (slots b*{group.block_size} .. b*{group.block_size}+"
                    f"{group.block_size - 1}, in order); this call names tokens inside "
                    f"a block")
        # Byte offset of tensor t's rows inside object i: exclusive cumsum over tensors.
        # Each tensor's bytes in each object, in one broadcast op (tokens x its row, or
        # its page): [objects, tensors].
        counts = torch.stack([tok.counts for tok in self.tokens], dim=1)  # [objects, groups]
        sizes = (counts.index_select(1, layout.tensor_group) * layout.row_bytes
                 + layout.page_bytes)
        self.base = torch.cumsum(sizes, dim=1) - sizes
        self.sizes = [int(s) for s in sizes.sum(dim=1).tolist()]
        #: the staged device path: where the engine's work ends, taken now, in the
        #: caller's thread (or the mark of an enclosing ``cuda.ordered_after``)
        self.mark: Optional[cuda.EngineMark] = None
        ops = layout.device_ops
        if ops is not None:
            self.mark = cuda.current_mark() or cuda.engine_mark(ops, layout.device)

    # ------------------------------------------------------------ copies
    def to_pool(self, items: Sequence[int], locs: Sequence[tuple[Segment, int]],
                task: Task) -> None:
        self._move(items, locs, task, save=True)

    def from_pool(self, items: Sequence[int], locs: Sequence[tuple[Segment, int]],
                  task: Task) -> None:
        self._move(items, locs, task, save=False)

    def _move(self, items: Sequence[int], locs: Sequence[tuple[Segment, int]], task: Task,
              save: bool) -> None:
        by_segment: dict[int, tuple[Segment, list[int], list[int]]] = {}
        for i, (seg, off) in zip(items, locs):
            entry = by_segment.setdefault(seg.id, (seg, [], []))
            entry[1].append(i)
            entry[2].append(off)
        n_obj = len(self.sizes)
        for seg, objs, offs in by_segment.values():
            with seg.use():
                if self.mark is not None:
                    self._move_staged(seg, objs, offs, task, save)
                else:
                    self._move_segment(seg, objs, offs, n_obj, task, save)

    # ------------------------------------------------------------ staged (device)
    def _move_staged(self, seg: Segment, objs: list[int], offs: list[int], task: Task,
                     save: bool) -> None:
        """The device path (:mod:`ems.client.staging`): plan, then run on the lane."""
        layout, ops, mark = self.layout, self.layout.device_ops, self.mark
        assert ops is not None and mark is not None
        device = layout.device
        if device.type == "cuda":
            seg.pin(device.index if device.index is not None else 0)
        sizes = [self.sizes[i] for i in objs]
        need = -(-max(sizes) // 64) * 64
        ln = staging.lane(ops, device, save)
        with ln.lock:
            ln.ensure(need)
            chunks = staging.plan_stages(objs, offs, sizes, ln.capacity,
                                         seg.pinning.chunk_bytes)
            staging.move(ln, seg.tensor(), chunks, task, mark, save,
                         lambda chunk, lane: self._fill(chunk, lane, save))

    def _fill(self, chunk: staging.StageChunk, ln: staging.Lane, save: bool) -> None:
        """Queue one chunk's gather (cache -> staging) or scatter (staging -> cache):
        per tensor one index op on the device, with the chunk's indices moved to the
        device once per layer group."""
        torch, layout = self._torch, self.layout
        dev, unit, up = ln.device, layout.unit, ln.ops.upload
        objs = torch.tensor(chunk.objects, dtype=torch.int64)
        soff = torch.tensor(chunk.stage_offsets, dtype=torch.int64)
        obj_stage = torch.full((len(self.sizes),), -1, dtype=torch.int64)
        obj_stage.index_copy_(0, objs, soff)
        base = self.base.index_select(0, objs)
        for gi, group in enumerate(layout.groups):
            tok = self.tokens[gi]
            cols = torch.tensor(group.tensors, dtype=torch.int64)
            ids = dest = None
            if tok.block_ids is not None:
                ids = up(tok.block_ids.index_select(0, objs), dev)
                # [tensors, objects]: each tensor's row of destinations is contiguous
                dest = up(((soff[:, None] + base.index_select(1, cols)) // unit)
                          .t().contiguous(), dev)
            toks = None
            for k, ti in enumerate(group.tensors):
                info = layout.tensors[ti]
                if ids is not None and dest is not None and info.blocks is not None:
                    win = ln.window(layout.dtype, info.blocks.shape[1])
                    self._copy_rows(info.blocks, ids, win, dest[k], save)
                    continue
                if toks is None:
                    keep = obj_stage.index_select(0, tok.obj) >= 0
                    tobj, pos = tok.obj[keep], tok.pos[keep]
                    toks = (up(tok.slots[keep], dev), tobj, pos,
                            obj_stage.index_select(0, tobj))
                slots, tobj, pos, tstage = toks
                tdest = up((tstage + self.base[tobj, ti] + pos * info.token_bytes) // unit,
                           dev)
                self._copy_tokens(info, slots, ln.window(layout.dtype, info.width), tdest,
                                  save)

    # ------------------------------------------------------------ host / torch
    def _move_segment(self, seg: Segment, objs: list[int], offs: list[int], n_obj: int,
                      task: Task, save: bool) -> None:
        torch = self._torch
        obj_off = torch.full((n_obj,), -1, dtype=torch.int64)
        obj_t = torch.tensor(objs, dtype=torch.int64)
        obj_off.index_copy_(0, obj_t, torch.tensor(offs, dtype=torch.int64))
        everything = len(objs) == n_obj
        selected: dict[int, _Selection] = {}
        use_native = native.available()
        runs: list[_Runs] = []
        for gi, group in enumerate(self.layout.groups):
            tok = self.tokens[gi]
            sel = selected.get(id(tok))
            if sel is None:
                sel = self._select(tok, obj_off, obj_t, everything)
                selected[id(tok)] = sel
            table = self.layout.host_runs[gi]
            if use_native and table.host:
                runs.extend(self._runs(seg, table, group, tok, obj_off, sel))
                continue
            slots, tobj, pos, blk_objs = sel
            unit = self.layout.unit
            for ti in group.tensors:
                info = self.layout.tensors[ti]
                task.checkpoint()
                if tok.block_ids is not None and info.blocks is not None:
                    dest = (obj_off[blk_objs] + self.base[blk_objs, ti]) // unit
                    width = info.blocks.shape[1]
                    window = seg.window(self.layout.dtype, width)
                    index = tok.block_ids[blk_objs]
                    self._copy_rows(info.blocks, index, window, dest, save)
                else:
                    dest = (obj_off[tobj] + self.base[tobj, ti] + pos * info.token_bytes
                            ) // unit
                    window = seg.window(self.layout.dtype, info.width)
                    self._copy_tokens(info, slots, window, dest, save)
        if runs:
            self._copy_runs(runs, task, save)

    def _runs(self, seg: Segment, table: _HostRuns, group: _Group, tok: _Tokens,
              obj_off: Tensor, sel: _Selection) -> list[_Runs]:
        """(pool address, cache address, length) of every run of one host group:
        whole blocks where the request's blocks are full and aligned, else tokens.

        Selections use ``index_select``, never ``t[index]``: advanced indexing runs
        on torch's intra-op threads even for a few thousand elements, and on a busy
        2-vCPU host a call then waited 3-12 ms (p99) for a preempted worker, against
        ~4 us for ``index_select`` (single-threaded at this size)."""
        slots, tobj, pos, blk_objs = sel
        out = []
        rest = table.rest
        if tok.block_ids is not None:
            cols = table.whole
            if cols is not None:
                blocks = tok.block_ids.index_select(0, blk_objs)[:, None]
                cache = cols.ptr + blocks * cols.stride0
                pool = (seg.address + obj_off.index_select(0, blk_objs)[:, None]
                        + self.base.index_select(0, blk_objs).index_select(1, cols.index))
                out.append((pool, cache, cols.block_bytes.expand_as(pool)))
        else:
            rest = table.all
        if rest is not None:
            bs = group.block_size
            cache = rest.ptr + (slots // bs)[:, None] * rest.stride0 + \
                (slots % bs)[:, None] * rest.stride1
            tb = rest.token_bytes
            pool = (seg.address + obj_off.index_select(0, tobj)[:, None]
                    + self.base.index_select(0, tobj).index_select(1, rest.index)
                    + pos[:, None] * tb)
            out.append((pool, cache, tb.expand_as(pool)))
        return out

    def _copy_runs(self, runs: list[_Runs], task: Task, save: bool) -> None:
        """One native call per ~``_CHUNK`` bytes for every run of the request, in the
        order of their source addresses (a checkpoint between calls).

        Reading the source in address order is what the hardware prefetcher follows:
        V1 block-16 saves (32 KiB runs of randomly chosen blocks of 64 tensors) ran
        12.5 GB/s in the request's order and 15.8 sorted by cache address; loads, whose
        source is the pool, 14.7 in tensor order and 16.5 in pool order (2-vCPU EPYC
        VM). Runs never overlap in their destination (each is its own object's range,
        or its own cache slot), so their order does not change the result."""
        torch = self._torch
        pool = torch.cat([r[0].reshape(-1) for r in runs])
        cache = torch.cat([r[1].reshape(-1) for r in runs])
        length = torch.cat([r[2].reshape(-1) for r in runs])
        dst, src = (pool, cache) if save else (cache, pool)
        if not dst.numel():
            return
        order = torch.argsort(src)
        dst, src = dst.index_select(0, order), src.index_select(0, order)
        length = length.index_select(0, order)  # (index_select: new contiguous tensors)
        ends = torch.cumsum(length, 0)
        total = int(ends[-1])
        cuts = [0]
        if total > _CHUNK:
            cuts += torch.searchsorted(ends, torch.arange(_CHUNK, total, _CHUNK),
                                       right=True).tolist()
        cuts.append(int(dst.numel()))
        d, s, n = dst.data_ptr(), src.data_ptr(), length.data_ptr()
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
                task.checkpoint()
                native.copy_table(d + 8 * lo, s + 8 * lo, n + 8 * lo, hi - lo)

    def _select(self, tok: _Tokens, obj_off: Tensor, obj_t: Tensor, everything: bool
                ) -> _Selection:
        if everything:
            return tok.slots, tok.obj, tok.pos, self._torch.arange(obj_off.numel())
        keep = obj_off.index_select(0, tok.obj) >= 0
        return tok.slots[keep], tok.obj[keep], tok.pos[keep], obj_t

    @staticmethod
    def _copy_rows(cache_rows: Tensor, index: Tensor, window: Tensor, dest: Tensor,
                   save: bool) -> None:
        device = cache_rows.device
        if save:
            rows = cache_rows.index_select(0, index.to(device))
            window.index_put_((dest,), rows.to(window.device))
        else:
            rows = window.index_select(0, dest).to(device)
            cache_rows.index_copy_(0, index.to(device), rows)

    def _copy_tokens(self, info: _TensorInfo, slots: Tensor, window: Tensor, dest: Tensor,
                     save: bool) -> None:
        if info.rows is not None:
            self._copy_rows(info.rows, slots, window, dest, save)
            return
        device = info.t3.device
        bs = info.t3.shape[1]
        b, p = (slots // bs).to(device), (slots % bs).to(device)
        if save:
            window.index_put_((dest,), info.t3[b, p].to(window.device))
        else:
            info.t3.index_put_((b, p), window.index_select(0, dest).to(device))
