"""The trace replay's pure cores (``ems.bench.trace_sim``): parsing, and the LRU,
offline-optimum and infinite simulations, on tiny hand-made traces whose answers are
worked out in the comments, and against brute-force models on generated
prefix-closed traces."""

from __future__ import annotations

import collections
import functools
import json

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from support.traces import synthetic_lines, write_trace

from ems.bench.trace_sim import (
    Trace,
    TraceRequest,
    belady,
    infinite,
    load_trace,
    lru,
    parse_trace,
)
from ems.errors import EmsErrorCode, EmsException


def trace(*chains: list[int]) -> Trace:
    return Trace(tuple(TraceRequest(i, 512 * len(c), 1, tuple(c))
                       for i, c in enumerate(chains)))


def test_shared_prefix_hits_its_leading_blocks():
    # [0,1] misses 2, [0,1] hits 2, [0,2] hits 0 (1) and misses 2: 3 of 6 at every size
    # that holds the three blocks, and LRU evicts 1 for 2 at capacity 2 (0 was touched)
    t = trace([0, 1], [0, 1], [0, 2])
    for sim in (lru, belady):
        assert sim(t, 2).hits == 3 and sim(t, 2).blocks == 6
    assert infinite(t).hits == 3
    # capacity 1: [0,1] leaves {1}; [0,1] misses 0, touches 1, then 0 evicts it: {0};
    # [0,2] hits 0
    assert lru(t, 1).hits == 1


def test_cyclic_working_set_one_larger_than_the_cache():
    # 0,1,2,0,1,2 in a cache of 2: LRU always evicts the next one asked (0 hits);
    # the optimum bypasses 2 (used farthest), hits 0 and 1, then misses 2: 2 hits
    t = trace([0], [1], [2], [0], [1], [2])
    assert lru(t, 2).hits == 0
    assert belady(t, 2).hits == 2
    assert infinite(t).hits == 3
    assert lru(t, 3).hits == belady(t, 3).hits == 3


def test_a_missing_first_block_loses_the_blocks_behind_it():
    # [0,1,2], then [3] evicts 0 (LRU), then [0,1,2]: 1 and 2 are stored but behind a
    # miss: 0 hits. The optimum bypasses 3 (never used again) and hits all 3.
    t = trace([0, 1, 2], [3], [0, 1, 2])
    assert lru(t, 3).hits == 0
    assert belady(t, 3).hits == 3
    assert infinite(t).hits == 3
    assert lru(t, 3).hit_rate == 0 and belady(t, 3).hit_rate == pytest.approx(3 / 7)


def test_lru_order_of_a_request_is_the_pools():
    # capacity 3: [0,1,2]; then [3,4,0]: its save reaches 3 first, evicting 0 (the
    # least recent), then 4 evicts 1, then 0 is missing again: it evicts 2 and is new.
    # The cache is {3,4,0}: [0] hits, [1] misses.
    t = trace([0, 1, 2], [3, 4, 0], [0], [1])
    assert lru(t, 3).hits == 1
    # [0,1] then [2,1] in a cache of 2: 2 evicts 0 before the save reaches 1 (stored,
    # set aside); so [1] hits, [0] misses
    t = trace([0, 1], [2, 1], [1], [0])
    assert lru(t, 2).hits == 1


def test_capacity_must_be_positive():
    for sim in (lru, belady):
        with pytest.raises(EmsException) as e:
            sim(trace([0]), 0)
        assert e.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "capacity" in e.value.message()


@pytest.mark.parametrize("line, field", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"hash_ids": [1, "x"]}', "hash_ids"),
    ('{"hash_ids": [1, -1]}', "hash_ids"),
    ('{"timestamp": 0}', "hash_ids"),
    ('{"hash_ids": [1, 2, 1]}', "repeat"),
    ('{"hash_ids": [1], "input_length": -5}', "input_length"),
    ('{"hash_ids": [1], "timestamp": 1.5}', "timestamp"),
])
def test_bad_lines_name_the_line_and_the_field(line, field):
    good = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1,
                       "hash_ids": [0]})
    with pytest.raises(EmsException) as e:
        parse_trace([good, "", line], "t.jsonl")
    assert e.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "t.jsonl line 3" in e.value.message() and field in e.value.message()


def test_load_plain_and_xz(tmp_path):
    lines = synthetic_lines(50, seed=1)
    a = load_trace(str(write_trace(tmp_path / "t.jsonl", lines)))
    b = load_trace(str(write_trace(tmp_path / "t.jsonl.xz", lines)))
    assert a == b and len(a.requests) == 50
    assert a.blocks == sum(len(json.loads(x)["hash_ids"]) for x in lines)
    assert a.head(10).requests == a.requests[:10]
    with pytest.raises(EmsException):
        load_trace(str(tmp_path / "absent.jsonl"))
    (tmp_path / "bad.xz").write_bytes(b"not xz")
    with pytest.raises(EmsException):
        load_trace(str(tmp_path / "bad.xz"))


def test_synthetic_trace_has_the_real_ones_structure():
    t = parse_trace(synthetic_lines(300, seed=2))
    first = collections.Counter(r.hash_ids[0] for r in t.requests)
    assert len(first) <= 3  # the hot set starts every request
    uses = collections.Counter(h for r in t.requests for h in r.hash_ids)
    assert sum(1 for n in uses.values() if n == 1) > len(uses) // 4  # one-hit blocks
    assert 0 < infinite(t).hit_rate < 1


# ------------------------------------------------------------------ against models

@st.composite
def prefix_closed(draw):
    """Requests that are root-to-node paths of a random forest: prefix-closed."""
    n = draw(st.integers(1, 9))
    parent = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]

    def path(v):
        out = []
        while v != -1:
            out.append(v)
            v = parent[v]
        return out[::-1]
    ends = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=7))
    return trace(*[path(v) for v in ends])


def optimum(t: Trace, capacity: int) -> int:
    """The most leading hits any eviction choice gets (exhaustive search): on each
    miss the block is inserted; over capacity, any block may go (it just came in: a
    bypass)."""
    flat = [(i, h) for i, r in enumerate(t.requests) for h in r.hash_ids]

    @functools.lru_cache(maxsize=None)
    def best(pos: int, cache: frozenset, lead_req: int) -> int:
        # lead_req: the request whose leading run is still unbroken (-1: none)
        if pos == len(flat):
            return 0
        req, h = flat[pos]
        first = pos == 0 or flat[pos - 1][0] != req
        leading = first or lead_req == req
        if h in cache:
            return (1 if leading else 0) + best(pos + 1, cache, req if leading else -1)
        grown = cache | {h}
        if len(grown) <= capacity:
            return best(pos + 1, grown, -1)
        return max(best(pos + 1, grown - {v}, -1) for v in grown)
    return best(0, frozenset(), -1)


def lru_model(t: Trace, capacity: int) -> int:
    """LRU as the pool runs it, on plain lists (most recent last): per request, the
    leading hits to the end in order; the save walks the rest in order, a stored block
    set aside (not evictable), a missing one evicting the head while the pool (order,
    set aside, reserved) is full, refused if nothing is evictable; then the set-aside
    blocks and the reserved ones to the end."""
    order: list[int] = []
    hits = 0
    for r in t.requests:
        lead = 0
        while lead < len(r.hash_ids) and r.hash_ids[lead] in order:
            lead += 1
        hits += lead
        for h in r.hash_ids[:lead]:
            order.remove(h)
            order.append(h)
        aside: list[int] = []
        reserved: list[int] = []
        for h in r.hash_ids[lead:]:
            if h in order:
                order.remove(h)
                aside.append(h)
                continue
            while order and len(order) + len(aside) + len(reserved) >= capacity:
                order.pop(0)
            if len(order) + len(aside) + len(reserved) < capacity:
                reserved.append(h)
        order += aside + reserved
    return hits


@settings(max_examples=300, deadline=None)
@given(prefix_closed(), st.integers(1, 5))
def test_belady_is_the_optimum_of_leading_hits(t, capacity):
    assert belady(t, capacity).hits == optimum(t, capacity)


@settings(max_examples=300, deadline=None)
@given(prefix_closed(), st.integers(1, 6))
def test_lru_against_a_list_model_and_the_bounds(t, capacity):
    a, b, inf = lru(t, capacity), belady(t, capacity), infinite(t)
    assert a.hits == lru_model(t, capacity)
    assert a.hits <= b.hits <= inf.hits
    assert a.blocks == b.blocks == inf.blocks == t.blocks
    if capacity >= t.distinct:
        assert a.hits == b.hits == inf.hits


# ------------------------------------------------------------------ the command line

@pytest.mark.parametrize("args, words", [
    (["--capacities", "0"], "--capacities"),
    (["--capacities", "10,x"], "--capacities"),
    (["--block-bytes", "1001"], "--block-bytes"),
    (["--trace-systems", "redis"], "--trace-systems"),
    (["--trace-requests", "0"], "--trace-requests"),
])
def test_bad_trace_options_are_refused_before_anything_runs(tmp_path, args, words):
    from ems.bench.runner import main
    path = write_trace(tmp_path / "t.jsonl", synthetic_lines(5))
    with pytest.raises(SystemExit) as e:
        main(["--trace", str(path), *args, "--json", str(tmp_path / "out.json")])
    assert words in str(e.value)
    assert not (tmp_path / "out.json").exists()


def test_a_bad_trace_file_is_refused_with_its_line(tmp_path):
    from ems.bench.runner import main
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [0]}\n{"hash_ids": "x"}\n')
    with pytest.raises(SystemExit) as e:
        main(["--trace", str(path), "--json", str(tmp_path / "out.json")])
    assert "line 2" in str(e.value) and "hash_ids" in str(e.value)
