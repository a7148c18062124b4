"""The control plane's database: SQLite in WAL mode, schema versioned by migrations.

Tables (schema version 2)::

    schema_version(version)                      one row: the migrations applied
    meta(name PRIMARY KEY, value)                'revision': bumped by every change
    tenants(access_id PRIMARY KEY, quota_bytes, created_at)
    keys(key_id PRIMARY KEY, access_id -> tenants, sealed, created_at, revoked_at)
    hosts(host PRIMARY KEY, report, reported_at) (v2: what each daemon last reported)

``MIGRATIONS`` is an ordered list; opening a database applies, in one transaction
each, the ones after its ``schema_version`` (a new file starts at 0), and refuses a
database newer than this code. The registry ``revision`` lets each daemon see in one
integer whether anything changed since its last poll.

One connection, guarded by a lock, serves the threads of the web server: SQLite
serialises writers anyway, and the work per request is a few rows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from typing import Any, Callable, Iterator, Optional

from ems.errors import EmsErrorCode, EmsException

__all__ = ["MIGRATIONS", "Database", "SCHEMA_VERSION"]

logger = logging.getLogger(__name__)


def _script(db: sqlite3.Connection, sql: str) -> None:
    """Statements one by one (``executescript`` would COMMIT the migration's
    transaction first)."""
    for statement in sql.split(";"):
        if statement.strip():
            db.execute(statement)


def _v1(db: sqlite3.Connection) -> None:
    _script(db, """
        CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
        INSERT INTO meta VALUES ('revision', 0);
        CREATE TABLE tenants (
            access_id TEXT PRIMARY KEY,
            quota_bytes INTEGER,
            created_at REAL NOT NULL);
        CREATE TABLE keys (
            key_id TEXT PRIMARY KEY,
            access_id TEXT NOT NULL REFERENCES tenants(access_id) ON DELETE CASCADE,
            sealed BLOB NOT NULL,
            created_at REAL NOT NULL,
            revoked_at REAL);
        CREATE INDEX keys_by_tenant ON keys(access_id);
    """)


def _v2(db: sqlite3.Connection) -> None:
    _script(db, """
        CREATE TABLE hosts (
            host TEXT PRIMARY KEY,
            report TEXT NOT NULL,
            reported_at REAL NOT NULL);
    """)


#: (version, migration) in order; a migration takes the schema from version - 1.
MIGRATIONS: list[tuple[int, Callable[[sqlite3.Connection], None]]] = [(1, _v1), (2, _v2)]
SCHEMA_VERSION = MIGRATIONS[-1][0]


class NotFound(EmsException):
    """A tenant or key that does not exist (HTTP 404)."""

    def __init__(self, message: str) -> None:
        super().__init__(EmsErrorCode.EMS_INVALID_ARGUMENT, message)


class Conflict(EmsException):
    """A tenant that exists already (HTTP 409)."""

    def __init__(self, message: str) -> None:
        super().__init__(EmsErrorCode.EMS_INVALID_ARGUMENT, message)


class Database:
    """The rows of the control plane (see the module docstring)."""

    def __init__(self, path: str, *, target: Optional[int] = None) -> None:
        """Open (creating) ``path`` and migrate it to ``target`` (default: the newest;
        tests pass an older one to build a database of an earlier release)."""
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                       timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self.migrate(SCHEMA_VERSION if target is None else target)
        except sqlite3.Error as exc:
            raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                               f"database {path}: {exc}") from exc

    # ------------------------------------------------------------ schema
    def version(self) -> int:
        row = self._db.execute("SELECT name FROM sqlite_master WHERE type='table' AND "
                               "name='schema_version'").fetchone()
        if row is None:
            return 0
        return int(self._db.execute("SELECT version FROM schema_version").fetchone()[0])

    def migrate(self, target: int) -> None:
        with self._lock:
            current = self.version()
            if current > SCHEMA_VERSION:
                raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT,
                                   f"database {self.path} has schema version {current}, "
                                   f"newer than this ems-control ({SCHEMA_VERSION})")
            for version, step in MIGRATIONS:
                if current < version <= target:
                    self._db.execute("BEGIN IMMEDIATE")
                    try:
                        step(self._db)
                        if version == 1:
                            self._db.execute("CREATE TABLE schema_version (version INTEGER)")
                            self._db.execute("INSERT INTO schema_version VALUES (1)")
                        else:
                            self._db.execute("UPDATE schema_version SET version = ?",
                                             (version,))
                        self._db.execute("COMMIT")
                    except BaseException:
                        self._db.execute("ROLLBACK")
                        raise
                    logger.info("ems-control: database %s migrated to schema %d",
                                self.path, version)
                    current = version

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock; SQLite errors (a full disk, a database
        locked past the timeout) leave as EMS_IO_ERROR naming the file."""
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                                   f"database {self.path}: {exc}") from exc

    def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``fn`` in a write transaction that also bumps the revision."""
        with self._locked() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(db)
                db.execute("UPDATE meta SET value = value + 1 WHERE name='revision'")
                db.execute("COMMIT")
                return out
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._locked() as db:
            return db.execute(sql, args).fetchall()

    def revision(self) -> int:
        return int(self._read("SELECT value FROM meta WHERE name='revision'")[0][0])

    # ------------------------------------------------------------ tenants
    def create_tenant(self, access_id: str, quota_bytes: Optional[int]) -> dict[str, Any]:
        def fn(db: sqlite3.Connection) -> None:
            try:
                db.execute("INSERT INTO tenants VALUES (?, ?, ?)",
                           (access_id, quota_bytes, time.time()))
            except sqlite3.IntegrityError:
                raise Conflict(f"tenant {access_id!r} exists already") from None
        self._write(fn)
        return self.tenant(access_id)

    def tenant(self, access_id: str) -> dict[str, Any]:
        rows = self._read("SELECT access_id, quota_bytes, created_at FROM tenants "
                          "WHERE access_id = ?", (access_id,))
        if not rows:
            raise NotFound(f"no tenant {access_id!r}")
        return self._tenant_row(rows[0])

    def tenants(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT access_id, quota_bytes, created_at FROM tenants "
                          "ORDER BY access_id")
        return [self._tenant_row(r) for r in rows]

    def _tenant_row(self, row: tuple) -> dict[str, Any]:
        active = self._read("SELECT count(*) FROM keys WHERE access_id = ? AND "
                            "revoked_at IS NULL", (row[0],))[0][0]
        return {"access_id": row[0], "quota_bytes": row[1], "created_at": row[2],
                "active_keys": active}

    def delete_tenant(self, access_id: str) -> None:
        def fn(db: sqlite3.Connection) -> None:
            if db.execute("DELETE FROM tenants WHERE access_id = ?",
                          (access_id,)).rowcount == 0:
                raise NotFound(f"no tenant {access_id!r}")
        self._write(fn)

    def set_quota(self, access_id: str, quota_bytes: Optional[int]) -> dict[str, Any]:
        def fn(db: sqlite3.Connection) -> None:
            if db.execute("UPDATE tenants SET quota_bytes = ? WHERE access_id = ?",
                          (quota_bytes, access_id)).rowcount == 0:
                raise NotFound(f"no tenant {access_id!r}")
        self._write(fn)
        return self.tenant(access_id)

    # ------------------------------------------------------------ keys
    def add_key(self, access_id: str, kid: str, sealed: bytes,
                revoke: Optional[str] = None) -> None:
        """Store a sealed key; ``revoke``: revoke that key of the tenant in the same
        transaction (rotation: the new key and the end of the old one are one change)."""
        def fn(db: sqlite3.Connection) -> None:
            if not db.execute("SELECT 1 FROM tenants WHERE access_id = ?",
                              (access_id,)).fetchone():
                raise NotFound(f"no tenant {access_id!r}")
            if revoke is not None:
                self._revoke(db, access_id, revoke)
            db.execute("INSERT INTO keys VALUES (?, ?, ?, ?, NULL)",
                       (kid, access_id, sealed, time.time()))
        self._write(fn)

    def revoke_key(self, access_id: str, kid: str) -> None:
        self._write(lambda db: self._revoke(db, access_id, kid))

    @staticmethod
    def _revoke(db: sqlite3.Connection, access_id: str, kid: str) -> None:
        row = db.execute("SELECT revoked_at FROM keys WHERE key_id = ? AND access_id = ?",
                         (kid, access_id)).fetchone()
        if row is None:
            raise NotFound(f"tenant {access_id!r} has no key {kid!r}")
        if row[0] is not None:
            raise Conflict(f"key {kid!r} of {access_id!r} is revoked already")
        db.execute("UPDATE keys SET revoked_at = ? WHERE key_id = ?", (time.time(), kid))

    def keys(self, access_id: str) -> list[dict[str, Any]]:
        self.tenant(access_id)  # 404 for an unknown tenant
        rows = self._read("SELECT key_id, created_at, revoked_at FROM keys WHERE "
                          "access_id = ? ORDER BY created_at", (access_id,))
        return [{"key_id": r[0], "created_at": r[1], "revoked_at": r[2],
                 "active": r[2] is None} for r in rows]

    def active_keys(self) -> tuple[int, list[tuple[str, Optional[int], list[tuple[str, bytes]]]]]:
        """The registry: (revision, [(access_id, quota_bytes, [(key_id, sealed)])]),
        read in one transaction so the revision matches the rows."""
        with self._locked() as db:
            db.execute("BEGIN")
            try:
                rev = int(db.execute(
                    "SELECT value FROM meta WHERE name='revision'").fetchone()[0])
                tenants = db.execute(
                    "SELECT access_id, quota_bytes FROM tenants ORDER BY access_id").fetchall()
                keys = db.execute(
                    "SELECT access_id, key_id, sealed FROM keys WHERE revoked_at IS NULL "
                    "ORDER BY created_at").fetchall()
            finally:
                db.execute("COMMIT")
        by_tenant: dict[str, list[tuple[str, bytes]]] = {t[0]: [] for t in tenants}
        for access_id, kid, sealed in keys:
            by_tenant[access_id].append((kid, sealed))
        return rev, [(t[0], t[1], by_tenant[t[0]]) for t in tenants]

    # ------------------------------------------------------------ host reports
    def put_report(self, host: str, report: dict[str, Any]) -> None:
        text = json.dumps(report, sort_keys=True)
        with self._locked() as db:
            db.execute("INSERT INTO hosts VALUES (?, ?, ?) ON CONFLICT(host) DO UPDATE "
                             "SET report = excluded.report, reported_at = excluded.reported_at",
                             (host, text, time.time()))

    def delete_report(self, host: str) -> bool:
        with self._locked() as db:
            return db.execute("DELETE FROM hosts WHERE host = ?", (host,)).rowcount > 0

    def reports(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT host, report, reported_at FROM hosts ORDER BY host")
        return [{"host": h, "reported_at": at, "report": json.loads(r)} for h, r, at in rows]
