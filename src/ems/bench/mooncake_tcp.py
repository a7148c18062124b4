"""Mooncake Store over TCP between processes: the cross-host peers (``mooncake-tcp``,
``mooncake-tcp-node``).

The layout is the one Mooncake runs across hosts, with every "host" on 127.0.0.1::

    bench process --control (unix socket, memfd passed once)--+--> host A worker
          |  caller memory: memfds mapped here and in each    |    real client, protocol
          |  worker, registered with the worker's store       |    "tcp", owns the global
          |                                                   |    segment; batch_put_from
          |                                                   +--> host B worker
          |                                                        real client, protocol
          v                                                        "tcp", no segment;
    mooncake_master (127.0.0.1, P2P handshake, no HTTP            batch_get_into
    metadata server)

A ``save`` is host A's ``batch_put_from`` of the caller's rows: with only A's segment
mounted the master places every value there, so the save is Mooncake's local write on
host A. A ``load`` is host B's ``batch_get_into``: B has no segment, so every byte
comes from A's segment through Mooncake's TCP transport (B reads from A's
``TcpTransport`` listener) into B's registered memory. That is the ems-cluster row's
workload (save on A, load on B, nothing of the value on B before the load); the bench
process checks the loaded bytes because B's buffers are memfds it maps too.

Two layouts (:data:`LAYOUTS`), two rows:

* ``mooncake-tcp`` (``host-a``): A's client owns the only segment, as above. The
  value crosses the network once, in the load; A's save is a local write.
* ``mooncake-tcp-node`` (``store-node``): a third process, ``mooncake_client`` with
  protocol "tcp", owns the only segment (a storage node, as a Valkey node is for
  ems); A and B have none. A save crosses TCP to the store node and a load crosses
  back, as ems-cluster's save (A -> the home node) and load (home node -> B) do.

Each call costs one control round trip on top of Mooncake's own work (a JSON frame of
the keys and its answer: measured 52 us p50, 88 us p90 with 64 keys on this host, the
``ping`` op, against 10-100 ms per batch of the bench); the timing is the bench's,
around that round trip. Every process (master, A, B, the store node) is a
:class:`ems.bench.procs.Service`: stopped by PID on :meth:`MooncakeTcpSystem.close`, on
a setup failure and at exit. A worker exits by itself when its control socket closes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import socket
import struct
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from ems.bench.procs import Service, free_port, wait_for
from ems.bench.systems import (
    BenchError,
    System,
    Unavailable,
    _mooncake_dir,
    _tcp_open,
    start_mooncake_master,
)

__all__ = ["MooncakeTcpSystem", "main"]

_HEADER = struct.Struct(">I")
_MAX_FRAME = 64 << 20
#: the local buffer each worker's client registers at setup (Mooncake wants one; the
#: values move between the registered caller memfds and A's segment, not through it)
LOCAL_BUFFER_BYTES = 64 << 20


# ---------------------------------------------------------------------- framing
def _send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    frame = _HEADER.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, into: bytearray) -> None:
    while len(into) < n:
        chunk = sock.recv(n - len(into))
        if not chunk:
            raise EOFError("control socket closed")
        into += chunk


def _recv(sock: socket.socket, want_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """One frame (and the file descriptors sent with its first bytes)."""
    fds: list[int] = []
    head = bytearray()
    if want_fds:
        data, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 4)
        if not data:
            raise EOFError("control socket closed")
        head += data
    _recv_exact(sock, _HEADER.size, head)
    (size,) = _HEADER.unpack(head)
    if size > _MAX_FRAME:
        raise BenchError(f"control frame of {size} bytes (limit {_MAX_FRAME})")
    body = bytearray()
    _recv_exact(sock, size, body)
    return json.loads(body), fds


# ---------------------------------------------------------------------- bench side
class _Worker:
    """One worker process (host A or B) and its control connection."""

    def __init__(self, role: str, work_dir: str, master: str, segment_bytes: int,
                 env: dict[str, str], timeout_s: float) -> None:
        self.role = role
        path = os.path.join(work_dir, f"mooncake-tcp-{role}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn: Optional[socket.socket] = None
        self.service: Optional[Service] = None
        try:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(0.2)
            self.service = Service(f"mooncake-tcp host {role}", [
                sys.executable, "-m", "ems.bench.mooncake_tcp", "--role", role,
                "--control", path, "--master", master, "--segment", str(segment_bytes),
            ], os.path.join(work_dir, f"mooncake-tcp-{role}.log"), env=env)
            deadline = time.monotonic() + timeout_s
            while self.conn is None:
                try:
                    self.conn, _ = listener.accept()
                except socket.timeout:
                    if not self.service.alive() or time.monotonic() > deadline:
                        raise Unavailable(f"mooncake-tcp host {role} did not connect "
                                          f"(exit code {self.service.proc.returncode}): "
                                          f"{self.service.log_tail()}") from None
            self.conn.settimeout(timeout_s)
            hello = self.call_raw(None)
            if hello.get("rc") != 0:
                raise Unavailable(f"mooncake-tcp host {role}: setup(protocol='tcp') "
                                  f"returned {hello.get('rc')}: {self.service.log_tail()}")
            self.conn.settimeout(120.0)  # a batch of the full bench: far below
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
            try:
                os.unlink(path)
            except OSError:
                pass

    def call_raw(self, msg: Optional[dict[str, Any]], fds: Sequence[int] = ()) -> dict:
        assert self.conn is not None
        try:
            if msg is not None:
                _send(self.conn, msg, fds)
            reply, _ = _recv(self.conn)
        except (OSError, EOFError, ValueError) as exc:
            tail = self.service.log_tail() if self.service is not None else ""
            raise BenchError(f"mooncake-tcp host {self.role}: {type(exc).__name__}: "
                             f"{exc}. {tail}") from exc
        if "error" in reply:
            raise BenchError(f"mooncake-tcp host {self.role}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the worker sees EOF and exits
            self.conn = None
        if self.service is not None:
            if self.service.alive():
                try:
                    self.service.proc.wait(2.0)
                except Exception:  # noqa: BLE001 - stop() below ends it
                    pass
            self.service.stop()
            self.service = None


#: Where the values live: on host A (a save is A's local write, a load crosses the
#: network once), or on a third process that only stores, as a Valkey node does (a
#: save crosses the network to it, a load crosses back: what ems-cluster's rows do).
LAYOUTS = {"host-a": "mooncake-tcp", "store-node": "mooncake-tcp-node"}


class MooncakeTcpSystem(System):
    """Save through host A's store, load through host B's, over Mooncake's TCP transport."""

    name, kind = "mooncake-tcp", "peer"

    def __init__(self, work_dir: str, capacity_bytes: int, timeout_s: float = 30.0,
                 layout: str = "host-a") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.name, self.layout = LAYOUTS[layout], layout
        work_dir = os.path.join(work_dir, self.name)
        os.makedirs(work_dir, exist_ok=True)
        mdir = _mooncake_dir()
        try:
            import mooncake.store  # noqa: F401 - fails without libibverbs
        except Exception as exc:  # noqa: BLE001 - reported as the reason
            raise Unavailable(f"mooncake.store does not import: {exc} (Debian libibverbs1 "
                              f"ibverbs-providers: bash benchmarks/setup-peers.sh)") from None
        import ems
        src = os.path.dirname(os.path.dirname(os.path.abspath(ems.__file__)))
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="2")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        self.capacity_bytes = capacity_bytes
        self._master: Optional[Service] = None
        self._store: Optional[Service] = None
        self.a: Optional[_Worker] = None
        self.b: Optional[_Worker] = None
        self._regions: list[tuple[int, int, int]] = []  # (address, nbytes, id)
        self._maps: list[mmap.mmap] = []
        try:
            try:
                self._master, address = start_mooncake_master(work_dir, env, timeout_s)
            except RuntimeError as exc:
                raise Unavailable(str(exc)) from None
            a_segment = capacity_bytes
            if layout == "store-node":
                a_segment, port = 0, free_port()
                self._store = Service("mooncake_client (store node)", [
                    os.path.join(mdir, "mooncake_client"), "--host=127.0.0.1",
                    f"--port={port}", f"--global_segment_size={capacity_bytes}",
                    "--local_buffer_size=16MB", "--protocol=tcp",
                    f"--master_server_address={address}", "--metadata_server=P2PHANDSHAKE",
                ], os.path.join(work_dir, "mooncake_store_node.log"), env=env)
                try:
                    wait_for("mooncake_client (store node)", lambda: _tcp_open(port),
                             self._store, timeout_s)
                except RuntimeError as exc:
                    raise Unavailable(str(exc)) from None
            self.a = _Worker("a", work_dir, address, a_segment, env, timeout_s)
            self.b = _Worker("b", work_dir, address, 0, env, timeout_s)
        except BaseException:
            self.close()
            raise

    def _workers(self) -> tuple[_Worker, _Worker]:
        if self.a is None or self.b is None:
            raise BenchError("mooncake-tcp is closed")
        return self.a, self.b

    def alloc(self, nbytes: int) -> np.ndarray:
        """A memfd mapped here and in both workers (registered with each one's store)."""
        a, b = self._workers()
        fd = os.memfd_create(f"ems-bench-mooncake-{len(self._regions)}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
            rid = len(self._regions)
            for w in (a, b):
                rc = w.call_raw({"op": "map", "id": rid, "nbytes": nbytes}, [fd])["rc"]
                if rc != 0:
                    raise Unavailable(f"mooncake-tcp host {w.role}: register_buffer "
                                      f"returned {rc}")
        finally:
            os.close(fd)
        self._maps.append(mm)
        arr = np.frombuffer(mm, dtype=np.uint8)
        self._regions.append((arr.ctypes.data, nbytes, rid))
        arr.fill(0)
        return arr

    def _rows(self, arr: np.ndarray) -> dict[str, Any]:
        n, size = arr.shape
        addr = arr.ctypes.data
        for base, nbytes, rid in self._regions:
            if base <= addr and addr + (n - 1) * arr.strides[0] + size <= base + nbytes:
                return {"id": rid, "start": addr - base, "stride": arr.strides[0],
                        "n": n, "size": size}
        raise BenchError("mooncake-tcp: rows outside the memory of alloc()")

    def save(self, keys: Sequence[str], src: np.ndarray) -> None:
        a, _ = self._workers()
        rcs = a.call_raw({"op": "put", "keys": list(keys), **self._rows(src)})["rcs"]
        bad = [rc for rc in rcs if rc != 0]
        if bad or len(rcs) != len(keys):
            raise BenchError(f"mooncake-tcp batch_put_from on host A: {len(bad)}/{len(keys)}"
                             f" failed (first code {bad[0] if bad else '?'})")

    def load(self, keys: Sequence[str], dst: np.ndarray) -> None:
        _, b = self._workers()
        rcs = b.call_raw({"op": "get", "keys": list(keys), **self._rows(dst)})["rcs"]
        bad = [rc for rc in rcs if rc != dst.shape[1]]
        if bad or len(rcs) != len(keys):
            raise BenchError(f"mooncake-tcp batch_get_into on host B: {len(bad)}/{len(keys)}"
                             f" failed (first code {bad[0] if bad else '?'})")

    def reset(self) -> None:
        a, _ = self._workers()
        a.call_raw({"op": "reset"})

    def warm(self, src: np.ndarray, capacity_bytes: int) -> None:
        """Touch A's segment once (as a long-running store has), then empty it."""
        written, seq = 0, 0
        while written + src.nbytes <= 0.9 * self.capacity_bytes:
            seq += 1
            self.save([f"warm{seq}-{i}" for i in range(src.shape[0])], src)
            written += src.nbytes
        self.reset()

    def info(self) -> dict[str, Any]:
        where = ("host A's real client owns the only segment (batch_put_from writes "
                 "locally)" if self.layout == "host-a" else
                 "a mooncake_client store node owns the only segment (host A's "
                 "batch_put_from crosses TCP to it)")
        return {"path": f"protocol 'tcp' on 127.0.0.1: {where}; host B's real client has "
                        f"none (batch_get_into over Mooncake's TCP transport)",
                "layout": self.layout, "global_segment_bytes": self.capacity_bytes}

    def close(self) -> None:
        for w in (self.b, self.a):
            if w is not None:
                w.close()
        self.a = self.b = None
        if self._store is not None:
            self._store.stop()
            self._store = None
        if self._master is not None:
            self._master.stop()
            self._master = None
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # the bench still holds views; freed with them
                pass
        self._maps.clear()


# ---------------------------------------------------------------------- worker side
def _serve(store: Any, sock: socket.socket) -> None:
    regions: dict[int, tuple[mmap.mmap, int]] = {}
    while True:
        try:
            msg, fds = _recv(sock, want_fds=True)
        except EOFError:
            return
        op = msg.get("op")
        try:
            if op == "map":
                if len(fds) != 1:
                    raise ValueError(f"map needs one fd, got {len(fds)}")
                mm = mmap.mmap(fds[0], int(msg["nbytes"]))
                os.close(fds[0])
                addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                regions[int(msg["id"])] = (mm, addr)
                reply: dict[str, Any] = {"rc": store.register_buffer(addr, len(mm))}
            elif op in ("put", "get"):
                _mm, base = regions[int(msg["id"])]
                first, stride, n, size = (int(msg[k]) for k in ("start", "stride", "n", "size"))
                ptrs = [base + first + i * stride for i in range(n)]
                call = store.batch_put_from if op == "put" else store.batch_get_into
                reply = {"rcs": list(call(msg["keys"], ptrs, [size] * n))}
            elif op == "ping":  # the control round trip alone (measured: docstring)
                reply = {"pong": True}
            elif op == "reset":
                reply = {"removed": store.remove_all(True)}  # force: a get leaves a lease
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 - answered, the bench reports it
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            reply = {"error": f"{op}: {type(exc).__name__}: {exc}"}
        _send(sock, reply)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """A worker: set up a real Mooncake client with protocol "tcp", then serve the bench."""
    ap = argparse.ArgumentParser(prog="python -m ems.bench.mooncake_tcp")
    ap.add_argument("--role", required=True, choices=("a", "b"))
    ap.add_argument("--control", required=True, help="the bench's unix socket")
    ap.add_argument("--master", required=True, help="mooncake_master RPC address")
    ap.add_argument("--segment", type=int, required=True,
                    help="global segment bytes this host mounts (0: none)")
    args = ap.parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.control)
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", args.segment, LOCAL_BUFFER_BYTES, "tcp",
                     "", args.master)
    _send(sock, {"rc": rc})
    try:
        if rc == 0:
            _serve(store, sock)
    finally:
        sock.close()
        try:
            store.close()
        except Exception:  # noqa: BLE001 - on the way out
            pass
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
