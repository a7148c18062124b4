"""The control plane's SQLite database: migrations, revisions, what a copy holds."""

from __future__ import annotations

import os
import sqlite3

import pytest

from ems.control.db import SCHEMA_VERSION, Conflict, Database, NotFound
from ems.control.keys import Sealer, generate_key
from ems.errors import EmsException


@pytest.fixture
def db(tmp_path):
    d = Database(str(tmp_path / "control.db"))
    yield d
    d.close()


def test_a_new_database_is_at_the_newest_schema_in_wal_mode(tmp_path, db):
    assert db.version() == SCHEMA_VERSION == 2
    raw = sqlite3.connect(str(tmp_path / "control.db"))
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        raw.close()
    assert {"schema_version", "meta", "tenants", "keys", "hosts"} <= tables


def test_a_v1_database_is_upgraded_in_place_keeping_its_rows(tmp_path):
    path = str(tmp_path / "old.db")
    old = Database(path, target=1)  # what the first release wrote
    assert old.version() == 1
    old.create_tenant("team-a", 8 << 20)
    old.add_key("team-a", "k-1", b"sealed-bytes")
    with pytest.raises(EmsException) as info:
        old.put_report("h", {})  # no hosts table in v1
    assert "no such table: hosts" in info.value.message()
    rev = old.revision()
    old.close()
    new = Database(path)
    try:
        assert new.version() == 2
        assert new.tenant("team-a")["quota_bytes"] == 8 << 20
        assert [k["key_id"] for k in new.keys("team-a")] == ["k-1"]
        assert new.revision() == rev
        new.put_report("h", {"x": 1})
        assert new.reports()[0]["report"] == {"x": 1}
    finally:
        new.close()


def test_a_database_newer_than_the_code_is_refused(tmp_path):
    path = str(tmp_path / "future.db")
    Database(path).close()
    raw = sqlite3.connect(path)
    raw.execute("UPDATE schema_version SET version = 99")
    raw.commit()
    raw.close()
    with pytest.raises(EmsException) as info:
        Database(path)
    assert "schema version 99" in info.value.message()


def test_every_change_bumps_the_revision_and_rotation_is_one_change(db):
    r0 = db.revision()
    db.create_tenant("team-a", None)
    db.add_key("team-a", "k-1", b"a")
    assert db.revision() == r0 + 2
    db.add_key("team-a", "k-2", b"b", revoke="k-1")
    assert db.revision() == r0 + 3
    rev, rows = db.active_keys()
    assert rev == r0 + 3 and rows == [("team-a", None, [("k-2", b"b")])]
    assert [(k["key_id"], k["active"]) for k in db.keys("team-a")] == [("k-1", False),
                                                                       ("k-2", True)]
    db.put_report("host", {"a": 1})
    assert db.revision() == r0 + 3  # reports are not registry changes


def test_refusals_change_nothing(db):
    db.create_tenant("team-a", None)
    db.add_key("team-a", "k-1", b"a")
    rev = db.revision()
    with pytest.raises(Conflict):
        db.create_tenant("team-a", None)
    with pytest.raises(NotFound):
        db.add_key("team-b", "k-2", b"b")
    with pytest.raises(NotFound):
        db.add_key("team-a", "k-2", b"b", revoke="k-404")  # rotation of an unknown key
    db.revoke_key("team-a", "k-1")
    with pytest.raises(Conflict):
        db.revoke_key("team-a", "k-1")
    with pytest.raises(NotFound):
        db.set_quota("team-b", 1 << 20)
    with pytest.raises(NotFound):
        db.delete_tenant("team-b")
    assert db.revision() == rev + 1  # only the one revocation
    assert [k["key_id"] for k in db.keys("team-a")] == ["k-1"]


def test_deleting_a_tenant_deletes_its_keys(db):
    db.create_tenant("team-a", None)
    db.add_key("team-a", "k-1", b"a")
    db.delete_tenant("team-a")
    assert db.tenants() == [] and db.active_keys()[1] == []
    db.create_tenant("team-a", None)
    assert db.keys("team-a") == []


def test_a_copy_of_the_database_holds_no_key_in_the_clear(tmp_path, db):
    sealer = Sealer(os.urandom(32))
    secret = generate_key()
    db.create_tenant("team-a", None)
    db.add_key("team-a", "k-1", sealer.seal(secret, "team-a", "k-1"))
    db.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert b"team-a" in raw  # the rows are there...
    assert secret.encode() not in raw  # ...the key is not
    db.__init__(str(tmp_path / "control.db"))  # reopened for the fixture's close
