"""ems's own block keys (``ems.integrations.block_keys``; no vLLM needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ems.integrations.block_keys import ROOT, block_digest, canonical, event_hash, key_of

TOKENS = list(range(100, 132))


def _chain(blocks, extras=None):
    out, parent = [], ROOT
    for i, tokens in enumerate(blocks):
        parent = block_digest(parent, tokens, None if extras is None else extras[i])
        out.append(key_of(parent))
    return out


def test_keys_chain_the_prefix():
    a = _chain([TOKENS, TOKENS[::-1]])
    assert _chain([TOKENS]) == a[:1]
    assert _chain([TOKENS[::-1], TOKENS[::-1]])[1] != a[1]  # another parent
    assert all(-(1 << 63) <= k < 1 << 63 for k in a)


def test_extra_keys_keep_requests_apart():
    lora = (("lora", "adapter-a", "/models/a"),)
    salt = (("cache_salt", "tenant-1"),)
    mm = (("mm", "f00d", 0),)
    keys = {_chain([TOKENS], [e])[0] for e in (None, lora, salt, mm,
                                                 (("lora", "adapter-b", "/models/a"),))}
    assert len(keys) == 5


def test_canonical_forms_never_share_an_encoding():
    values = [None, True, False, 0, 1, "1", b"1", "", b"", ("a", "b"), ("ab",), ["ab"],
              ("a", ("b",)), (("a", "b"),), -1, 1 << 70]
    encodings = [canonical(v) for v in values]
    # a tuple and a list of the same items are the same key (vLLM makes tuples)
    assert encodings[10] == encodings[11]
    del encodings[11]
    assert len(set(encodings)) == len(encodings)
    with pytest.raises(TypeError):
        canonical(1.5)
    with pytest.raises(TypeError):
        canonical({"a": 1})


def test_same_keys_in_processes_with_other_hash_seeds():
    code = ("from ems.integrations.block_keys import *\n"
            "d = block_digest(ROOT, list(range(32)), (('lora', 'x', 'p'), ('mm', 'h', 3)))\n"
            "print(key_of(d), hash('x'))")
    outs = []
    for seed in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join(sys.path))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.split())
    assert len({o[0] for o in outs}) == 1  # the key
    assert len({o[1] for o in outs}) == 3  # while Python's own hash() differs


def test_event_hash_is_what_vllm_publishes():
    """vLLM's maybe_convert_block_hash: the big-endian int's low 64 bits, unsigned."""
    h = bytes(range(32))
    assert event_hash(h) == int.from_bytes(h[-8:], "big")
    assert event_hash(b"\xff" * 32) == (1 << 64) - 1
    assert event_hash(-1) == (1 << 64) - 1 and event_hash(7) == 7
