"""The daemon side of ems-control: fetch the registry, apply it live, report back.

One background thread does all the waiting and the slow work; the event loop only
swaps in what is ready::

    sync thread (every control_poll_s)                     event loop
    ----------------------------------                     ----------
    GET /v1/registry (daemon token) --fail--> keep the last registry, log once
       | revision changed
       v
    open the keys (transport key from the daemon token),
    create the memfds of new tenants (fallocate: ms per 100 MiB)
       |  plan ready --> daemon.wake() (the wake socketpair) -->  _apply(plan):
       |                                                           add new tenants,
       |                                                           swap key sets, close
       |                                                           sessions of revoked keys
       |                                                           and deleted tenants,
       |                                                           set quotas (Pool.set_capacity)
    LoopSnapshots.get() (report built on the loop)
    POST /v1/hosts/{host}/report

A revoked key therefore stops opening sessions at most ``control_poll_s`` (1 s by
default) plus one request after the revocation, and the sessions it opened are closed
in the same step; a new tenant can connect as soon. When the control plane is down the
daemon keeps serving with the registry it has (in memory only: a daemon started while
the control plane is down serves no control-plane tenant until it is back).

Memory: a tenant's segment (its memfd, sealed against growing and shrinking) is sized
to its quota when this daemon creates it, and segments together stay within the
daemon's ``capacity`` (a tenant that does not fit is refused, logged and reported,
and tried again at the next registry change). A later quota at most the segment
applies live as the pool's usage limit (LRU eviction down to it, nothing else
dropped); a quota above the segment raises the limit to the segment only, and the
daemon says so (log, ``quota_bytes`` > ``capacity_bytes`` in its report): create
tenants with the largest quota they will need and lower it, or restart the daemon.

In control mode the tenants file is not used; the anonymous namespace exists only
with an explicit ``anonymous_quota`` (its share cannot be "what the others leave"
when the others come and go).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

from ems.config import validate_access_id
from ems.errors import EmsException, invalid
from ems.protocol.report import DaemonReport, LocalTierRow, Wire
from ems.server.config import ServerConfig
from ems.server.snapshots import LoopSnapshots
from ems.server.tenants import Tenant, TenantSpec

__all__ = ["ControlSync", "Plan", "static_specs"]

logger = logging.getLogger(__name__)

_MIN_QUOTA = 1 << 20


def static_specs(config: ServerConfig) -> list[TenantSpec]:
    """The namespaces of a control-mode daemon that do not come from the control
    plane: the anonymous one, when it has an explicit quota."""
    if not config.anonymous:
        return []
    if config.anonymous_quota_bytes is None:
        logger.info("ems-server: anonymous access is off under a control plane unless "
                    "anonymous_quota is set")
        return []
    if config.anonymous_quota_bytes > config.capacity_bytes:
        raise invalid(f"anonymous_quota {config.anonymous_quota_bytes} is more than capacity "
                      f"{config.capacity_bytes}")
    return [TenantSpec(None, None, config.anonymous_quota_bytes)]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One registry revision, ready for the loop: the keys opened, new segments made."""

    revision: int
    #: access_id -> (quota_bytes, {key_id: access_key})
    tenants: dict[str, tuple[int, dict[str, str]]]
    #: segments made for tenants this daemon does not have yet
    new: dict[str, Tenant]
    #: access_ids that did not fit into the daemon's capacity (-> why)
    refused: dict[str, str]


class ControlSync:
    """The registry thread of one daemon (see the module docstring)."""

    def __init__(self, config: ServerConfig, daemon: Any) -> None:
        from ems.sealing import read_secret_file, transport_sealer
        assert config.control and config.control_token_file
        self.config = config
        self.daemon = daemon
        self.url = config.control.rstrip("/")
        self.host = config.host_name or f"{socket.gethostname()}:{config.socket_dir}"
        self._token = read_secret_file(config.control_token_file, "control_token_file")
        self._transport = transport_sealer(self._token)
        self._timeout_s = min(5.0, max(1.0, 2 * config.control_poll_s))
        self._snapshots = LoopSnapshots(daemon)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ems-control-sync",
                                        daemon=True)
        self._lock = threading.Lock()
        self._pending: Optional[Plan] = None
        self._applied = threading.Event()  # the loop took the last plan
        self._applied.set()
        #: what the thread believes the loop has: access_id -> segment bytes
        self._segments: dict[str, int] = {}
        self._seen_revision: Optional[int] = None
        # counters (plain ints: read by the exporter and the report)
        self.revision: Optional[int] = None  # applied on the loop
        self.applied_at = 0.0
        self.fetch_errors = 0
        self.report_errors = 0
        self.closed_sessions = 0
        self.refused: dict[str, str] = {}
        self.reachable = False
        daemon.wake_hooks.append(self._apply)
        daemon.control_sync = self  # the exporter finds it there

    # ------------------------------------------------------------ thread
    def start(self) -> "ControlSync":
        self._thread.start()
        logger.info("ems-server: tenants from %s as host %r, polled every %.2f s",
                    self.url, self.host, self.config.control_poll_s)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._applied.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout_s + 2)
        plan, self._pending = self._pending, None
        if plan is not None:  # made but never applied: give the memory back
            for tenant in plan.new.values():
                tenant.close()

    def _run(self) -> None:
        period = self.config.control_poll_s
        first = True
        while not self._stop.is_set():
            started = time.monotonic()
            self._poll()
            if first and not self.reachable and self.config.control_cache:
                self._from_cache()
            first = False
            if not self._stop.is_set():
                self._report()
            self._stop.wait(max(0.0, period - (time.monotonic() - started)))

    def _request(self, method: str, path: str, body: Optional[bytes] = None) -> Any:
        req = urllib.request.Request(self.url + path, data=body, method=method)
        req.add_header("Authorization", f"Bearer {self._token}")
        if body is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=self._timeout_s) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _poll(self) -> None:
        # One plan at a time: the next one is built against what the loop has.
        if not self._applied.wait(self._timeout_s) or self._stop.is_set():
            return
        known = "" if self._seen_revision is None else f"?known={self._seen_revision}"
        try:
            data = self._request("GET", "/v1/registry" + known)
            if isinstance(data, dict) and data.get("unchanged") is True and \
                    data.get("revision") == self._seen_revision:
                revision, tenants = self._seen_revision, None
            else:
                revision, tenants = self._decode(data)
        except (OSError, ValueError, EmsException) as exc:
            self.fetch_errors += 1
            if self.reachable or self.fetch_errors == 1:
                logger.warning("ems-server: control plane %s: %s; serving with the registry "
                               "of revision %s", self.url, _why(exc), self.revision)
            self.reachable = False
            return
        if not self.reachable:
            logger.info("ems-server: control plane %s reachable (revision %d)", self.url,
                        revision)
        self.reachable = True
        if tenants is not None and revision is not None and revision != self._seen_revision:
            self._hand_over(self._plan(revision, tenants))
            if self.config.control_cache:
                try:
                    self._write_cache(data)
                except OSError as exc:
                    logger.error("ems-server: cannot write control_cache %s: %s",
                                 self.config.control_cache, exc.strerror)

    def _hand_over(self, plan: Plan) -> None:
        with self._lock:
            self._pending = plan
            self._applied.clear()
        self._seen_revision = plan.revision
        self.daemon.wake()

    def _write_cache(self, data: Any) -> None:
        path = self.config.control_cache
        assert path is not None
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    def _from_cache(self) -> None:
        """The control plane did not answer the first fetch: serve the cached registry."""
        path = self.config.control_cache
        assert path is not None
        try:
            st = os.stat(path)
            if st.st_mode & 0o077:
                raise ValueError(f"mode {st.st_mode & 0o777:04o}, not 0600")
            with open(path) as f:
                revision, tenants = self._decode(json.load(f))
        except FileNotFoundError:
            return
        except (OSError, ValueError, EmsException) as exc:
            logger.error("ems-server: control_cache %s not used: %s", path, _why(exc))
            return
        logger.warning("ems-server: serving the registry of revision %d from %s until the "
                       "control plane answers", revision, path)
        self._hand_over(self._plan(revision, tenants))

    def _decode(self, data: Any) -> tuple[int, dict[str, tuple[int, dict[str, str]]]]:
        if not isinstance(data, dict) or not isinstance(data.get("revision"), int) or \
                not isinstance(data.get("tenants"), list):
            raise ValueError("the registry is not {revision, tenants}")
        out: dict[str, tuple[int, dict[str, str]]] = {}
        for row in data["tenants"]:
            access_id, quota = row.get("access_id"), row.get("quota_bytes")
            validate_access_id(access_id)
            if type(quota) is not int or quota < _MIN_QUOTA:
                raise ValueError(f"tenant {access_id!r}: quota_bytes {quota!r}")
            keys = {k["key_id"]: self._transport.open_text(k["sealed"], access_id,
                                                           k["key_id"])
                    for k in row.get("keys", ())}
            out[access_id] = (quota, keys)
        return data["revision"], out

    def _plan(self, revision: int, tenants: dict[str, tuple[int, dict[str, str]]]) -> Plan:
        """Make the segments of new tenants (off the loop), within the capacity."""
        segments = {k: v for k, v in self._segments.items() if k in tenants}
        static = sum(t.segment_size for t in self.daemon.registry if t.source == "config")
        new: dict[str, Tenant] = {}
        refused: dict[str, str] = {}
        for access_id, (quota, _keys) in sorted(tenants.items()):
            if access_id in segments:
                continue
            free = self.config.capacity_bytes - static - sum(segments.values())
            if quota > free:
                refused[access_id] = (f"quota {quota} bytes does not fit: {free} of capacity "
                                      f"{self.config.capacity_bytes} left")
                continue
            try:
                tenant = Tenant(TenantSpec(access_id, None, quota),
                                self.config.reservation_ttl_s, clock=self.daemon.clock,
                                huge_pages=self.config.huge_pages)
            except OSError as exc:
                refused[access_id] = f"cannot make its {quota}-byte segment: {exc.strerror}"
                continue
            tenant.source = "control"
            new[access_id] = tenant
            segments[access_id] = tenant.segment_size
        for access_id, why in refused.items():
            if self.refused.get(access_id) != why:
                logger.error("ems-server: tenant %r refused on this daemon: %s", access_id, why)
        self._segments = segments
        return Plan(revision, tenants, new, refused)

    def _report(self) -> None:
        report = self._snapshots.get(timeout_s=1.0)
        if report is None:
            return
        payload = _payload(report)
        payload["host"] = self.host
        payload["control"] = self.state()
        try:
            self._request("POST", "/v1/hosts/" + urllib.parse.quote(self.host, safe="") +
                          "/report", json.dumps(payload).encode())
        except (OSError, ValueError) as exc:
            self.report_errors += 1
            logger.debug("ems-server: report to %s failed: %s", self.url, _why(exc))

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "reachable": self.reachable, "revision": self.revision,
                "fetch_errors": self.fetch_errors, "report_errors": self.report_errors,
                "closed_sessions": self.closed_sessions, "refused": dict(self.refused)}

    # ------------------------------------------------------------ loop
    def _apply(self) -> None:
        """Swap in the pending plan (on the event loop; no I/O, no allocation)."""
        with self._lock:
            plan, self._pending = self._pending, None
        if plan is None:
            return
        try:
            self._apply_plan(plan)
        finally:
            self._applied.set()

    def _apply_plan(self, plan: Plan) -> None:
        daemon, registry = self.daemon, self.daemon.registry
        for tenant in [t for t in registry if t.source == "control"]:
            if tenant.spec.access_id not in plan.tenants:
                n = daemon.close_sessions(lambda t, _k, gone=tenant: t is gone,
                                          f"tenant {tenant.name!r} was deleted")
                self.closed_sessions += n
                registry.remove(tenant.spec.access_id)
                daemon.delete_tenant(tenant)
                logger.info("ems-server: tenant %r deleted (%d session(s) closed)",
                            tenant.name, n)
        for access_id, (quota, keys) in plan.tenants.items():
            tenant = registry.get(access_id)
            if tenant is None:
                tenant = plan.new.get(access_id)
                if tenant is None:
                    continue  # refused (no room)
                tenant.keys = dict(keys)
                registry.add(tenant)
                logger.info("ems-server: tenant %r added: quota %d MiB, %d key(s)",
                            access_id, quota >> 20, len(keys))
                continue
            revoked = set(tenant.keys) - set(keys)
            tenant.keys = dict(keys)
            if revoked:
                n = daemon.close_sessions(
                    lambda t, k, mine=tenant, gone=revoked: t is mine and k in gone,
                    "this session's access key was revoked")
                self.closed_sessions += n
                logger.info("ems-server: tenant %r: key(s) %s revoked, %d session(s) closed",
                            access_id, ", ".join(sorted(revoked)), n)
            if quota != tenant.quota_bytes:
                limit = tenant.pool.set_capacity(min(quota, tenant.segment_size))
                tenant.quota_bytes = quota
                if quota > tenant.segment_size:
                    logger.warning("ems-server: tenant %r: quota %d MiB is above its segment "
                                   "of %d MiB (sealed at its first quota); the pool is "
                                   "limited to the segment until this daemon restarts",
                                   access_id, quota >> 20, tenant.segment_size >> 20)
                else:
                    logger.info("ems-server: tenant %r: quota now %d MiB (pool limit %d MiB)",
                                access_id, quota >> 20, limit >> 20)
        for tenant in plan.new.values():  # made, but the tenant exists already
            if registry.get(tenant.spec.access_id) is not tenant:
                tenant.close()
        self.refused = dict(plan.refused)
        self.revision = plan.revision
        self.applied_at = time.time()


def _payload(report: DaemonReport) -> dict[str, Wire]:
    """The wire of ``report`` for the control plane: each tenant's shared memory as a
    tier beside its others (``tiers.local``), so its page shows them side by side."""
    tenants = {}
    for name, t in report.tenants.items():
        local = LocalTierRow(hits=t.hits, misses=t.misses, hit_bytes=t.hit_bytes)
        tenants[name] = dataclasses.replace(t, tiers=dataclasses.replace(t.tiers, local=local))
    return dataclasses.replace(report, tenants=tenants).to_wire()


def _why(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"unreachable ({exc.reason})"
    if isinstance(exc, EmsException):
        return exc.message()
    return f"{type(exc).__name__}: {exc}"

