"""A file system that knows what a power cut would leave: a test double of the disk
store's I/O layer (``ems.disk.io.FileSystem``) in the spirit of Jepsen's LazyFS.

:class:`PowerCutFileSystem` passes every call through to the host's files (the store
under test runs for real) and keeps a journal of every change it made: each write
(with its bytes), truncation, ``fsync``/``fdatasync``, file creation, ``mkdir``,
``rename`` and ``unlink``, in the order the kernel saw them. From the journal,
:meth:`~PowerCutFileSystem.image` builds into a real directory what the disk would hold
after a power cut right after any journal entry, by the letter of fsync(2):

* a file's bytes are durable once the file was ``fsync``\\ ed or ``fdatasync``\\ ed
  after they were written;
* a name (a file created, a directory made, a rename, an unlink) is durable only once
  its directory was ``fsync``\\ ed after the change: a new file whose directory was
  never synced is gone, whatever was synced inside it, and so is everything under a
  directory whose own name is not durable;
* everything else may or may not have reached the disk. With ``rng=None`` nothing
  of it did (LazyFS's "clear the cache"); with a ``random.Random``, each write not yet
  durable independently survives whole, is lost, or is torn (a prefix of 512-byte
  sectors landed, the rest left as it was, zeroed or garbage), and a random prefix of
  the name changes not yet durable survived (a journaling file system commits its
  metadata in order).

The state machine of one name::

    (absent) --create/mkdir/rename-to--> volatile --fsync(dir)--> durable
                                           |  cut: gone           |  cut: kept
    durable --unlink/rename-from--> volatile-gone --fsync(dir)--> (absent)
                                      cut: still there

And of one byte range of a file::

    written --fsync/fdatasync(file)--> durable
       | cut: kept, lost or torn          | cut: kept (if the file's name is)

What is outside the model: the file system's own crash consistency (a durable name
points to the durable bytes of its file, never to another file's), and reads, which
pass through untouched. Every call and its journal entry happen under one lock, so
the journal's order is the order the kernel saw (tests then run their threads one
system call at a time, which is what a journal needs, not a limit of the store).
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from ems.disk.io import LOCAL, DirEntry, FileSystem

__all__ = ["Create", "Event", "MakeDir", "Note", "PowerCutFileSystem", "Rename", "Sync",
           "SyncDir", "Truncate", "Unlink", "Write"]

#: the sector a torn write tears at (the unit a device writes atomically)
SECTOR = 512


@dataclass(frozen=True)
class Write:
    """``data`` written at ``offset`` of file ``node``."""

    node: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class Truncate:
    node: int
    size: int


@dataclass(frozen=True)
class Sync:
    """fsync or fdatasync of file ``node``: its bytes so far are durable."""

    node: int


@dataclass(frozen=True)
class Create:
    """File ``node`` created as ``name`` in directory ``parent``."""

    parent: int
    name: str
    node: int


@dataclass(frozen=True)
class MakeDir:
    """Directory ``node`` made as ``name`` in directory ``parent``."""

    parent: int
    name: str
    node: int


@dataclass(frozen=True)
class Rename:
    """``src`` renamed to ``dst`` (replacing it) within directory ``parent``."""

    parent: int
    src: str
    dst: str
    node: int


@dataclass(frozen=True)
class Unlink:
    parent: int
    name: str


@dataclass(frozen=True)
class SyncDir:
    """fsync of directory ``node``: its names so far are durable."""

    node: int
    path: str


@dataclass(frozen=True)
class Note:
    """A mark the test put in the journal (no effect on the disk)."""

    text: str


Event = Union[Write, Truncate, Sync, Create, MakeDir, Rename, Unlink, SyncDir, Note]
_Name = Union[Create, MakeDir, Rename, Unlink]
_Data = Union[Write, Truncate]


def _apply_data(data: bytearray, op: _Data) -> None:
    if isinstance(op, Truncate):
        del data[op.size:]
        data.extend(bytes(max(0, op.size - len(data))))
        return
    end = op.offset + len(op.data)
    if len(data) < op.offset:
        data.extend(bytes(op.offset - len(data)))
    data[op.offset:end] = op.data


def _apply_name(entries: dict[str, int], op: _Name) -> None:
    if isinstance(op, (Create, MakeDir)):
        entries[op.name] = op.node
    elif isinstance(op, Rename):
        entries.pop(op.src, None)
        entries[op.dst] = op.node
    else:
        entries.pop(op.name, None)


@dataclass
class _File:
    durable: bytearray = field(default_factory=bytearray)
    current: bytearray = field(default_factory=bytearray)
    pending: list[_Data] = field(default_factory=list)


@dataclass
class _Dir:
    durable: dict[str, int] = field(default_factory=dict)
    current: dict[str, int] = field(default_factory=dict)


class _Replay:
    """The disk after a prefix of the journal: durable and current state per node."""

    def __init__(self, files: dict[int, bytes], dirs: dict[int, dict[str, int]]) -> None:
        self.files = {n: _File(bytearray(b), bytearray(b)) for n, b in files.items()}
        self.dirs = {n: _Dir(dict(e), dict(e)) for n, e in dirs.items()}
        self.pending_names: list[_Name] = []

    def apply(self, e: Event) -> None:
        if isinstance(e, (Write, Truncate)):
            f = self.files[e.node]
            _apply_data(f.current, e)
            f.pending.append(e)
        elif isinstance(e, Sync):
            f = self.files[e.node]
            f.durable = bytearray(f.current)
            f.pending.clear()
        elif isinstance(e, SyncDir):
            d = self.dirs[e.node]
            d.durable = dict(d.current)
            self.pending_names = [p for p in self.pending_names if p.parent != e.node]
        elif isinstance(e, Note):
            pass
        else:
            if isinstance(e, Create):
                self.files[e.node] = _File()
            elif isinstance(e, MakeDir):
                self.dirs[e.node] = _Dir()
            _apply_name(self.dirs[e.parent].current, e)
            self.pending_names.append(e)

    def survivor(self, node: int, rng: Optional[random.Random]) -> bytes:
        f = self.files[node]
        data = bytearray(f.durable)
        if rng is None:
            return bytes(data)
        for op in f.pending:
            fate = rng.random()
            if fate < 1 / 3:
                _apply_data(data, op)
            elif fate < 2 / 3 or isinstance(op, Truncate):
                continue  # lost
            else:  # torn: a prefix of sectors landed, the rest is old, zeros or garbage
                keep = rng.randrange(len(op.data) // SECTOR + 1) * SECTOR
                rest = len(op.data) - keep
                how = rng.randrange(3)
                tail = b"" if how == 0 else bytes(rest) if how == 1 else rng.randbytes(rest)
                _apply_data(data, Write(op.node, op.offset, op.data[:keep] + tail))
        return bytes(data)


class PowerCutFileSystem:
    """See the module docstring. ``base`` is a directory the test owns (its name and
    what is in it now count as durable); the store's directory goes inside it."""

    def __init__(self, base: str, inner: FileSystem = LOCAL) -> None:
        self._base = os.path.abspath(base)
        self._inner = inner
        self._lock = threading.Lock()
        self._journal: list[Event] = []
        self._next = 0
        self._paths: dict[str, int] = {}  # the current names (absolute) -> node
        self._fds: dict[int, int] = {}
        files: dict[int, bytes] = {}
        dirs: dict[int, dict[str, int]] = {}
        self._paths[self._base] = self._new()
        for top, subdirs, names in os.walk(self._base):
            entries = dirs.setdefault(self._paths[top], {})
            for name in subdirs:
                node = self._paths[os.path.join(top, name)] = self._new()
                entries[name] = node
            for name in names:
                path = os.path.join(top, name)
                node = self._paths[path] = self._new()
                entries[name] = node
                with open(path, "rb") as fh:
                    files[node] = fh.read()
        self._initial_files = files
        self._initial_dirs = dirs

    def _new(self) -> int:
        self._next += 1
        return self._next

    # --- the journal ------------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        """A copy of the journal; a cut point ``k`` is "right after ``events[k - 1]``"."""
        with self._lock:
            return list(self._journal)

    def note(self, text: str) -> None:
        """Put a mark in the journal (e.g. "written k1" when a write returned)."""
        with self._lock:
            self._journal.append(Note(text))

    def _replay(self, cut: int) -> _Replay:
        with self._lock:
            events = self._journal[:cut]
        state = _Replay(self._initial_files, self._initial_dirs)
        for e in events:
            state.apply(e)
        return state

    def contents(self, cut: int, path: str) -> Optional[bytes]:
        """What a reader saw at ``path`` right after ``cut`` journal entries (no power
        cut): None when there was no such file."""
        state = self._replay(cut)
        node = self._paths[self._base]
        for part in os.path.relpath(os.path.abspath(path), self._base).split(os.sep):
            got = state.dirs[node].current.get(part) if node in state.dirs else None
            if got is None:
                return None
            node = got
        f = state.files.get(node)
        return None if f is None else bytes(f.current)

    def image(self, cut: int, into: str, rng: Optional[random.Random] = None) -> None:
        """Write into the directory ``into`` (made here; it must not exist) what ``base``
        holds after a power cut right after ``cut`` journal entries (see the module
        docstring; ``rng=None``: only what was durable)."""
        state = self._replay(cut)
        entries = {n: dict(d.durable) for n, d in state.dirs.items()}
        lucky = rng.randrange(len(state.pending_names) + 1) if rng is not None else 0
        for op in state.pending_names[:lucky]:
            _apply_name(entries[op.parent], op)
        os.makedirs(into, mode=0o700)
        todo = [(self._paths[self._base], into)]
        while todo:
            node, path = todo.pop()
            for name, child in sorted(entries[node].items()):
                where = os.path.join(path, name)
                if child in entries:
                    os.mkdir(where, 0o700)
                    todo.append((child, where))
                else:
                    fd = os.open(where, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                    try:
                        os.write(fd, state.survivor(child, rng))
                    finally:
                        os.close(fd)

    # --- FileSystem -------------------------------------------------------------------

    def _node(self, path: str) -> int:
        node = self._paths.get(os.path.abspath(path))
        if node is None:
            raise RuntimeError(f"{path}: not made through this file system, nor there "
                               "when it was constructed")
        return node

    def _parent(self, path: str) -> tuple[int, str]:
        path = os.path.abspath(path)
        return self._node(os.path.dirname(path)), os.path.basename(path)

    def open_file(self, path: str, *, create: bool = False, exclusive: bool = False,
                  truncate: bool = False, direct: bool = False) -> int:
        path = os.path.abspath(path)
        with self._lock:
            existed = path in self._paths
            fd = self._inner.open_file(path, create=create, exclusive=exclusive,
                                       truncate=truncate, direct=direct)
            if existed:
                node = self._paths[path]
            elif create:
                parent, name = self._parent(path)
                node = self._paths[path] = self._new()
                self._journal.append(Create(parent, name, node))
            else:
                self._inner.close(fd)
                node = self._node(path)  # raises: a file the model does not know
            if truncate and existed:
                self._journal.append(Truncate(node, 0))
            self._fds[fd] = node
            return fd

    def lock(self, path: str) -> int:
        path = os.path.abspath(path)
        with self._lock:
            existed = path in self._paths
            fd = self._inner.lock(path)
            if existed:
                node = self._paths[path]
            else:
                parent, name = self._parent(path)
                node = self._paths[path] = self._new()
                self._journal.append(Create(parent, name, node))
            self._fds[fd] = node
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._inner.close(fd)
            self._fds.pop(fd, None)

    def write_at(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        with self._lock:
            done = self._inner.write_at(fd, views, offset)
            data = b"".join(bytes(v) for v in views)[:max(0, done)]
            self._journal.append(Write(self._fds[fd], offset, data))
            return done

    def read_at(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        return self._inner.read_at(fd, views, offset)

    def read_bytes(self, fd: int, n: int, offset: int) -> bytes:
        return self._inner.read_bytes(fd, n, offset)

    def file_size(self, fd: int) -> int:
        return self._inner.file_size(fd)

    def sync_data(self, fd: int) -> None:
        with self._lock:
            self._inner.sync_data(fd)
            self._journal.append(Sync(self._fds[fd]))

    def sync_file(self, fd: int) -> None:
        with self._lock:
            self._inner.sync_file(fd)
            self._journal.append(Sync(self._fds[fd]))

    def make_dir(self, path: str) -> bool:
        path = os.path.abspath(path)
        with self._lock:
            made = self._inner.make_dir(path)
            if made:
                parent, name = self._parent(path)
                node = self._paths[path] = self._new()
                self._journal.append(MakeDir(parent, name, node))
            return made

    def make_private(self, path: str) -> None:
        self._inner.make_private(path)

    def sync_dir(self, path: str) -> None:
        path = os.path.abspath(path)
        with self._lock:
            self._inner.sync_dir(path)
            node = self._paths.get(path)
            if node is not None:  # above base: outside the model (durable by assumption)
                self._journal.append(SyncDir(node, path))

    def rename(self, src: str, dst: str) -> None:
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        if os.path.dirname(src) != os.path.dirname(dst):
            raise RuntimeError("the model renames within one directory only")
        with self._lock:
            self._inner.rename(src, dst)
            parent, name = self._parent(src)
            node = self._paths.pop(src)
            self._paths[dst] = node
            self._journal.append(Rename(parent, name, os.path.basename(dst), node))

    def unlink(self, path: str) -> None:
        path = os.path.abspath(path)
        with self._lock:
            self._inner.unlink(path)
            parent, name = self._parent(path)
            self._paths.pop(path, None)
            self._journal.append(Unlink(parent, name))

    def exists(self, path: str) -> bool:
        return self._inner.exists(path)

    def dir_id(self, path: str) -> int:
        return self._inner.dir_id(path)

    def list_dir(self, path: str) -> list[DirEntry]:
        return self._inner.list_dir(path)

    def total_bytes(self, path: str) -> int:
        return self._inner.total_bytes(path)
