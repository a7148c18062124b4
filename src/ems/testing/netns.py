"""A multi-host test bed: hosts as Linux network namespaces joined by a switch.

::

    from ems.testing.netns import NetBed

    with NetBed(hosts=3, directory=tmp) as bed:   # root only (skip otherwise)
        a = bed.server(1)                         # ems-server in host 1's namespace
        bed.cut(3)                                # host 3's switch port down
        bed.impair(1, 0, delay_ms=1)              # host 1 -> every node: +1 ms each way
        bed.heal()

Layout (every name starts with a prefix unique to the run, ``ems<pid>x<random>-``)::

    <p>sw  switch namespace: bridge br0 (10.77.255.254/16) + relay addresses
           10.77.1.j/16; the relay (``ems.testing.relay``) forwards 10.77.1.j:7000
           to node j, impaired per (host, node)
    <p>h1  host 1: eth0 10.77.0.1/16 (veth; its peer p1 is a port of br0),
           valkey-server on 10.77.0.1:7000 (bus 17000), an ems-server
    ...    (one per host)

Nothing is attached to the root namespace: each veth pair is created inside the
switch namespace with its peer moved straight into the host's. The test process
talks to the daemons over their unix sockets (pathname sockets do not belong to a
network namespace) and to the Valkey nodes from a thread that entered the switch
namespace (``setns``), so every address it uses is inside the bed.

Faults: :meth:`NetBed.cut` (a switch port down: the host's packets are dropped, both
ways, for every peer), :meth:`NetBed.impair` (per host and node through the relay:
block = a one-way partition of that pair, delay, loss, rate; see
``ems.testing.relay`` for what each emulates), :meth:`NetBed.stop_node` /
:meth:`NetBed.cont_node` (SIGSTOP / SIGCONT: a hung node). The bed checks whether the
kernel has ``sch_netem`` (:attr:`NetBed.netem`, said in :attr:`NetBed.impairment`)
but impairs with the relay either way: one model of delay and loss on every machine,
so figures from two machines compare (netem's real packet loss is left for a kernel
that has it).

Cleanup: :meth:`NetBed.close` (the ``with`` block's end, and ``atexit`` for a killed
test run's normal exit) kills every process the bed started by its pid and deletes
every namespace it created, also after a failure half-way through setup.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, TypeVar

from ems.cluster import launcher
from ems.cluster.keys import SLOTS, hash_slot

__all__ = ["NODE_PORT", "PORTS", "NetBed", "in_netns", "unavailable"]

T = TypeVar("T")

NODE_PORT = 7000
#: every host's ports a node may listen on (the relay forwards each): the primary,
#: its replica of another host's primary, one added later (:meth:`NetBed.add_node`)
PORTS = (NODE_PORT, NODE_PORT + 1, NODE_PORT + 2)
_CLONE_NEWNET = 0x40000000
_SWITCH_ADDR = "10.77.255.254"


def unavailable() -> Optional[str]:
    """Why this machine cannot run the bed (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    name = f"ems{os.getpid()}probe{random.randrange(1 << 30):x}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    try:
        launcher.server_binary()
    except launcher.LauncherError as exc:
        return str(exc)
    return None


def _run(*args: str) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _ok(reply: Any) -> None:
    if reply != "OK":
        raise RuntimeError(f"the bed's cluster: a node answered {reply!r}")


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread inside network namespace ``name`` (sockets it creates stay
    there); its result or its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {name}")
            finally:
                os.close(fd)
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
    t = threading.Thread(target=run, name=f"netns-{name}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


class NetBed:
    """See the module docstring. ``hosts`` namespaces, one Valkey primary each
    (slots split evenly: node j owns the j-th range) on port 7000; ``replicas``: host
    j+1 also runs a replica of node j on port 7001 (the last host's replicates host
    1's); ``relay`` False: clients reach the nodes directly (figures of the bare veth
    path), no :meth:`impair`."""

    def __init__(self, hosts: int = 3, directory: Optional[str] = None, *,
                 relay: bool = True, replicas: bool = False, node_timeout_ms: int = 2000,
                 maxmemory: str = "256mb") -> None:
        if not 1 <= hosts <= 200:
            raise ValueError("hosts must be 1..200")
        self.hosts = hosts
        self.relay = relay
        self.replicas = replicas
        self.prefix = f"ems{os.getpid()}x{random.randrange(1 << 16):04x}-"
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="ems-netbed-")
        self._node_timeout_ms = node_timeout_ms
        self._maxmemory = maxmemory
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        #: (host, port) -> the valkey-server there
        self.nodes: dict[tuple[int, int], subprocess.Popen] = {}
        self._servers: list[Any] = []  # context managers of run_server
        self._relay: Optional[subprocess.Popen] = None
        self._rules: dict[tuple[int, int], dict[str, Any]] = {}
        self._closed = False
        #: whether delay/loss use the kernel's netem (else the relay)
        self.netem = False
        atexit.register(self.close)

    # ------------------------------------------------------------ names
    @property
    def switch(self) -> str:
        return self.prefix + "sw"

    def ns(self, host: int) -> str:
        """Host ``host``'s namespace (hosts count from 1)."""
        return f"{self.prefix}h{host}"

    @staticmethod
    def addr(host: int) -> str:
        return f"10.77.0.{host}" if host < 255 else f"10.77.{host >> 8}.{host & 255}"

    def client_addr(self, node: int) -> str:
        """Where clients reach node ``node`` (the relay's address for it, or the node)."""
        return f"10.77.1.{node}" if self.relay else self.addr(node)

    @property
    def seed(self) -> str:
        return "valkey://" + ",".join(f"{self.client_addr(j)}:{NODE_PORT}"
                                      for j in range(1, self.hosts + 1))

    def slot_range(self, node: int) -> tuple[int, int]:
        return (SLOTS * (node - 1) // self.hosts, SLOTS * node // self.hosts - 1)

    def node_of(self, cluster_key: bytes) -> int:
        """The node that owns ``cluster_key``'s slot (as the bed assigned them)."""
        slot = hash_slot(cluster_key)
        return next(j for j in range(1, self.hosts + 1)
                    if self.slot_range(j)[0] <= slot <= self.slot_range(j)[1])

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "NetBed":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        self._netns_add(self.switch)
        sw = ["ip", "-n", self.switch]
        _run(*sw, "link", "set", "lo", "up")
        _run(*sw, "link", "add", "br0", "type", "bridge")
        _run(*sw, "addr", "add", f"{_SWITCH_ADDR}/16", "dev", "br0")
        for j in range(1, self.hosts + 1):
            _run(*sw, "addr", "add", f"10.77.1.{j}/16", "dev", "br0")
        _run(*sw, "link", "set", "br0", "up")
        for i in range(1, self.hosts + 1):
            h = self.ns(i)
            self._netns_add(h)
            _run(*sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
                 "netns", h)
            _run(*sw, "link", "set", f"p{i}", "master", "br0", "up")
            _run("ip", "-n", h, "link", "set", "lo", "up")
            _run("ip", "-n", h, "addr", "add", f"{self.addr(i)}/16", "dev", "eth0")
            _run("ip", "-n", h, "link", "set", "eth0", "up")
        self.netem = subprocess.run(
            ["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", "p1", "root",
             "netem", "delay", "0ms"], capture_output=True).returncode == 0
        if self.netem:
            _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", "p1",
                 "root")
        if self.relay:
            self._start_relay()
        for j in range(1, self.hosts + 1):
            self._start_node(j)
        if self.replicas:
            for j in range(1, self.hosts + 1):
                self._start_node(j % self.hosts + 1, NODE_PORT + 1)
        self._form_cluster(time.monotonic() + 30)

    def _netns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)

    def _spawn(self, ns: str, args: list[str], **kw: Any) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *args], start_new_session=True,
                                **kw)  # ip netns exec execs: proc.pid is the program's
        self.procs.append(proc)
        return proc

    def _start_relay(self) -> None:
        args = [sys.executable, "-m", "ems.testing.relay"]
        for j in range(1, self.hosts + 1):
            for port in PORTS:
                args += ["--listen", f"{j}=10.77.1.{j}:{port}={self.addr(j)}:{port}"]
        for i in range(1, self.hosts + 1):
            args += ["--host", f"{i}={self.addr(i)}"]
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.abspath(str(__import__("ems").__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        self._relay = self._spawn(self.switch, args, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert self._relay.stdout is not None
        line = self._relay.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the relay did not start (said {line!r})")

    def _start_node(self, j: int, port: int = NODE_PORT) -> None:
        ndir = os.path.join(self.directory, f"node{j}-{port}")
        os.makedirs(ndir, exist_ok=True)
        args = [launcher.server_binary(), "--port", str(port), "--bind", self.addr(j),
                "--dir", ndir, "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self._node_timeout_ms),
                "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "yes",
                "--save", "", "--appendonly", "no", "--protected-mode", "no",
                "--maxmemory", self._maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--logfile", os.path.join(ndir, "valkey.log"), "--daemonize", "no"]
        if self.relay:
            args += ["--cluster-announce-client-ipv4", self.client_addr(j)]
        self.nodes[(j, port)] = self._spawn(self.ns(j), args, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)

    def call(self, node: int, *args: Any, timeout_s: float = 2.0, port: int = NODE_PORT
             ) -> Any:
        """One command to the node on host ``node`` (from the switch namespace, direct;
        ``port`` 7001: its replica, 7002: one added)."""
        return in_netns(self.switch, lambda: launcher.call(
            port, *args, timeout_s=timeout_s, host=self.addr(node)))

    def _form_cluster(self, deadline: float) -> None:
        nodes = range(1, self.hosts + 1)

        def wait(check: Callable[[], bool], what: str) -> None:
            while True:
                with contextlib.suppress(OSError, ValueError):
                    if check():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the bed's cluster: {what}")
                time.sleep(0.05)
        def pong(j: int) -> Callable[[], bool]:
            return lambda: bool(self.call(j, "PING", timeout_s=0.5) == "PONG")
        for j in nodes:
            wait(pong(j), f"valkey-server of host {j} did not start")
        for j in nodes:
            lo, hi = self.slot_range(j)
            _ok(self.call(j, "CLUSTER", "ADDSLOTSRANGE", lo, hi))
            _ok(self.call(j, "CLUSTER", "SET-CONFIG-EPOCH", j))
        every = list(self.nodes)
        for j, port in every[1:]:
            _ok(self.call(j, "CLUSTER", "MEET", self.addr(1), NODE_PORT, port=port))
        wait(lambda: all(self.call(j, "CLUSTER", "NODES", port=port).decode()
                         .count("connected") >= len(every) for j, port in every),
             "the nodes did not all meet")
        if self.replicas:
            for j in nodes:
                primary = self.call(j, "CLUSTER", "MYID").decode()
                _ok(self.call(j % self.hosts + 1, "CLUSTER", "REPLICATE", primary,
                              port=NODE_PORT + 1))
        wait(lambda: all("cluster_state:ok" in self.call(j, "CLUSTER", "INFO", port=port)
                         .decode() for j, port in every), "no cluster_state:ok")

    def add_node(self, host: int, port: int = NODE_PORT + 2) -> str:
        """Start an empty primary on ``host``:``port`` and join it (no slots yet);
        its node id."""
        self._start_node(host, port)
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError, ValueError):
                if self.call(host, "PING", timeout_s=0.5, port=port) == "PONG":
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node on host {host} port {port} did not start")
            time.sleep(0.05)
        _ok(self.call(host, "CLUSTER", "MEET", self.addr(1), NODE_PORT, port=port))
        return str(self.call(host, "CLUSTER", "MYID", port=port).decode())

    def server(self, host: int, **kw: Any) -> Any:
        """Start an ``ems-server --cluster <bed seed>`` in ``host``'s namespace (the
        arguments of :func:`ems.testing.run_server`; its socket dir in a temp dir);
        the :class:`~ems.testing.ServerProcess`, stopped by :meth:`close`."""
        from ems.testing import run_server
        directory = os.path.join(self.directory, f"server{host}-{len(self._servers)}")
        os.makedirs(directory)
        extra = ["--cluster", self.seed, *kw.pop("extra_args", ())]
        cm = run_server(directory, netns=self.ns(host), extra_args=extra, **kw)
        server = cm.__enter__()
        self._servers.append(cm)
        return server

    # ------------------------------------------------------------ faults
    def cut(self, host: int) -> None:
        """Host ``host``'s switch port down: it reaches nothing, nothing reaches it."""
        _run("ip", "-n", self.switch, "link", "set", f"p{host}", "down")

    def uncut(self, host: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", f"p{host}", "up")

    def impair(self, host: int, node: int, **rule: Any) -> None:
        """Impair the path from ``host``'s clients to ``node`` (0: every host / node):
        ``block``, ``delay_ms``, ``loss``, ``rate_bps`` (``ems.testing.relay``); an
        empty rule removes the pair's."""
        if self._relay is None:
            raise RuntimeError("this bed has no relay (NetBed(relay=True))")
        if rule:
            self._rules[(host, node)] = rule
        else:
            self._rules.pop((host, node), None)
        self._tell_relay()

    def _tell_relay(self) -> None:
        relay = self._relay
        assert relay is not None and relay.stdin is not None and relay.stdout is not None
        rules = [[i, j, r] for (i, j), r in self._rules.items()]
        relay.stdin.write(json.dumps({"rules": rules}) + "\n")
        relay.stdin.flush()
        if relay.stdout.readline().strip() != "ok":
            raise RuntimeError("the relay did not take the rules")

    def stop_node(self, node: int, port: int = NODE_PORT) -> None:
        """SIGSTOP the valkey-server on host ``node`` (a hung node)."""
        self.nodes[(node, port)].send_signal(signal.SIGSTOP)

    def cont_node(self, node: int, port: int = NODE_PORT) -> None:
        self.nodes[(node, port)].send_signal(signal.SIGCONT)

    def kill_node(self, node: int, port: int = NODE_PORT) -> None:
        """SIGKILL the valkey-server on host ``node`` (by its pid) and reap it."""
        proc = self.nodes[(node, port)]
        proc.kill()
        proc.wait(5)

    def heal(self) -> None:
        """Every port up, every rule gone, every node running."""
        for i in range(1, self.hosts + 1):
            self.uncut(i)
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        if self._relay is not None and self._rules:
            self._rules.clear()
            self._tell_relay()

    def wait_ok(self, timeout_s: float = 15.0) -> float:
        """Until every running node says ``cluster_state:ok`` (a primary that was cut
        off from the majority refuses writes for a rejoin delay after the heal:
        Valkey's ``cluster-node-timeout``, 0.5-5 s); the seconds it took."""
        t0 = time.monotonic()
        while True:
            try:
                if all("cluster_state:ok" in self.call(j, "CLUSTER", "INFO", port=port,
                                                       timeout_s=0.5).decode()
                       for (j, port), proc in self.nodes.items() if proc.poll() is None):
                    return time.monotonic() - t0
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError("the bed's cluster did not return to cluster_state:ok")
            time.sleep(0.05)

    @property
    def impairment(self) -> str:
        """One line for a test's output: how the links are impaired here."""
        if self.netem:
            return ("sch_netem is available, but links are impaired in user space by a "
                    "TCP relay in the switch namespace (ems.testing.relay), as everywhere")
        return ("no sch_netem in this kernel: links impaired in user space by a TCP "
                "relay in the switch namespace (ems.testing.relay)")

    # ------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Stop every process by its pid, delete every namespace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for cm in reversed(self._servers):
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(5)
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
        atexit.unregister(self.close)
