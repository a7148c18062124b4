"""The disk's side file of engine hashes (``ems.server.disk_announce``): what is
written is read back, any flipped byte or cut end is refused as a whole, and the file
is replaced atomically."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from ems.server import disk_announce as da

_rows = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.lists(st.tuples(st.text(max_size=20), st.integers(0, (1 << 64) - 1)), max_size=20),
    max_size=4)


@given(_rows)
def test_what_is_written_is_read_back(rows):
    got = da.decode(da.encode(rows))
    assert got == {t: {da.key_digest(k): h for k, h in pairs} for t, pairs in rows.items()}


@given(_rows, st.data())
def test_a_damaged_file_is_refused_whole(rows, data):
    raw = bytearray(da.encode(rows))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= 1 << data.draw(st.integers(0, 7))
    assert da.decode(bytes(raw)) is None
    assert da.decode(bytes(raw[:at])) is None  # cut short


def test_save_replaces_the_file_and_load_reads_it(tmp_path):
    assert da.load(str(tmp_path)) == {}  # none yet
    da.save(str(tmp_path), {"t": [("k", 7)]})
    da.save(str(tmp_path), {"t": [("k", 8), ("j", 9)]})
    assert da.load(str(tmp_path)) == {"t": {da.key_digest("k"): 8, da.key_digest("j"): 9}}
    assert os.listdir(tmp_path) == [da.FILE]  # no temporary file left
    (tmp_path / da.FILE).write_bytes(b"garbage" * 10)
    assert da.load(str(tmp_path)) == {}  # damaged: nothing announced
