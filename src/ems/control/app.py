"""The REST service of ``ems-control`` (FastAPI; OpenAPI at ``/docs`` and
``/openapi.json``).

Who may call what::

    admin token  --> /v1/tenants..., /v1/hosts...   (manage tenants, keys, quotas; read state)
    daemon token --> GET /v1/registry, POST /v1/hosts/{host}/report   (the daemons)
    nobody       --> /, /static/*, /healthz, /docs, /openapi.json   (no data in them)

Both tokens are bearer tokens (``Authorization: Bearer ...``), compared with
``hmac.compare_digest``; a missing or wrong one is answered 401 before any database
work. A key's secret appears in exactly one answer: the one that issued it (issue or
rotate); listings show key ids only. Access ids follow the SDK's own rule
(``ems.config.validate_access_id``), and may hold ``/``: paths take them as the
rest of the path (``{access_id:path}``), so ``/v1/tenants/a/b/keys`` is the keys of
tenant ``a/b``.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import os
import time
from typing import Any, Optional, Union

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from ems.config import parse_bytes, validate_access_id
from ems.control.config import ControlConfig
from ems.control.db import Conflict, Database, NotFound
from ems.control.keys import (
    KEY_DEFAULT,
    KEY_MAX,
    KEY_MIN,
    Sealer,
    generate_key,
    key_id,
    read_secret_file,
    transport_sealer,
)
from ems.errors import EmsErrorCode, EmsException, invalid
from ems.protocol.report import DaemonReport, TenantRow, Wire

__all__ = ["Service", "create_app"]

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_MAX_REPORT_BYTES = 1 << 20


def _pool_row(t: TenantRow) -> dict[str, Wire]:
    """What ``/v1/pool`` shows of a tenant's row in a daemon's report."""
    return {"quota_bytes": t.quota_bytes, "capacity_bytes": t.capacity_bytes,
            "arena_bytes": t.arena_bytes, "used_bytes": t.used_bytes, "objects": t.objects,
            "connections": t.connections, "hits": t.hits, "misses": t.misses,
            "miss_absent": t.miss_absent, "miss_size_mismatch": t.miss_size_mismatch,
            "miss_pending": t.miss_pending, "evictions": t.evictions,
            "tiers": t.tiers.to_wire()}


class TenantIn(BaseModel):
    access_id: str = Field(description="the tenant's EmsConfig.access_id")
    quota: Optional[Union[int, str]] = Field(
        None, description="pool size on each daemon: bytes or 512M/4G (default: the "
                          "service's default quota)")
    issue_key: bool = Field(False, description="also issue a first access key")


class QuotaIn(BaseModel):
    quota: Optional[Union[int, str]] = Field(
        description="bytes or 512M/4G; null: back to the default quota")


class KeyIn(BaseModel):
    length: int = Field(KEY_DEFAULT, ge=KEY_MIN, le=KEY_MAX,
                        description="characters of 0-9 A-Z a-z + / =")


class Service:
    """The state behind the routes: database, sealers, tokens, limits."""

    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        os.makedirs(config.state_dir, mode=0o700, exist_ok=True)
        token = base64.b64encode(os.urandom(32)).decode()
        master = read_secret_file(config.file("master.key"), "master key file",
                                  create=base64.b64encode(os.urandom(32)).decode())
        try:
            master_key = base64.b64decode(master, validate=True)
        except ValueError:
            raise invalid(f"master key file {config.file('master.key')} is not base64") from None
        self.sealer = Sealer(master_key)
        self.admin_token = config.admin_token or read_secret_file(
            config.file("admin.token"), "admin token file", create=token)
        self.daemon_token = config.daemon_token or read_secret_file(
            config.file("daemon.token"), "daemon token file",
            create=base64.b64encode(os.urandom(32)).decode())
        if hmac.compare_digest(self.admin_token, self.daemon_token):
            raise invalid("the admin and daemon tokens must differ")
        self.transport = transport_sealer(self.daemon_token)
        self.db = Database(config.file("control.db"))

    # ------------------------------------------------------------ checks
    def check_id(self, access_id: str) -> str:
        try:
            validate_access_id(access_id)
        except EmsException as exc:
            raise invalid(f"access_id {access_id!r}: {exc.message()}") from None
        if {"keys", "quota"} & set(access_id.split("/")[1:]):
            raise invalid(f"access_id {access_id!r}: a '/'-separated part after the first "
                          f"must not be 'keys' or 'quota' (they name sub-resources)")
        return access_id

    def quota(self, value: Optional[Union[int, str]]) -> Optional[int]:
        if value is None:
            return None
        q = parse_bytes(value, "quota")
        if not (1 << 20) <= q <= self.config.max_quota_bytes:
            raise invalid(f"quota must be in 1 MiB..{self.config.max_quota_bytes} bytes "
                          f"(max_quota), got {q}")
        return q

    def issue(self, access_id: str, length: int, revoke: Optional[str] = None
              ) -> dict[str, Any]:
        secret = generate_key(length)
        kid = key_id()
        self.db.add_key(access_id, kid, self.sealer.seal(secret, access_id, kid), revoke)
        logger.info("ems-control: issued key %s for %r%s", kid, access_id,
                    f" (rotating {revoke})" if revoke else "")
        return {"access_id": access_id, "key_id": kid, "access_key": secret,
                "revoked": revoke}

    def registry(self) -> dict[str, Any]:
        """What every daemon applies: tenants, quotas, active keys sealed for transport."""
        revision, rows = self.db.active_keys()
        tenants = []
        for access_id, quota, keys in rows:
            sealed = []
            for kid, blob in keys:
                secret = self.sealer.open(blob, access_id, kid)
                sealed.append({"key_id": kid,
                               "sealed": self.transport.seal_text(secret, access_id, kid)})
            tenants.append({"access_id": access_id,
                            "quota_bytes": quota or self.config.default_quota_bytes,
                            "keys": sealed})
        return {"revision": revision, "tenants": tenants}

    def hosts(self) -> list[dict[str, Any]]:
        now = time.time()
        out = []
        for row in self.db.reports():
            row["age_s"] = round(now - row["reported_at"], 3)
            out.append(row)
        return out


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _deny(why: str) -> HTTPException:
    return HTTPException(401, why, headers={"WWW-Authenticate": "Bearer"})


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="ems-control",
                  description="Tenants, access keys and quotas of every ems-server; "
                              "the pool state they report.",
                  version="1")

    def admin(request: Request) -> None:
        token = _bearer(request)
        if not token:
            raise _deny("an admin bearer token is required")
        if not hmac.compare_digest(token.encode(), service.admin_token.encode()):
            raise _deny("wrong admin token")

    def daemon(request: Request) -> None:
        token = _bearer(request)
        if not token:
            raise _deny("a daemon bearer token is required")
        if not hmac.compare_digest(token.encode(), service.daemon_token.encode()):
            raise _deny("wrong daemon token")

    @app.exception_handler(EmsException)
    async def _ems_error(_request: Request, exc: EmsException) -> JSONResponse:
        status = (404 if isinstance(exc, NotFound) else 409 if isinstance(exc, Conflict) else
                  503 if exc.status_code() is EmsErrorCode.EMS_IO_ERROR else 400)
        return JSONResponse({"detail": exc.message(), "code": exc.status_code().name},
                            status_code=status)

    a = [Depends(admin)]

    # ---------------------------------------------------------------- tenants
    @app.get("/v1/tenants", dependencies=a, tags=["tenants"])
    def list_tenants() -> list[dict[str, Any]]:
        return service.db.tenants()

    @app.post("/v1/tenants", dependencies=a, status_code=201, tags=["tenants"])
    def create_tenant(body: TenantIn) -> dict[str, Any]:
        access_id = service.check_id(body.access_id)
        out = service.db.create_tenant(access_id, service.quota(body.quota))
        logger.info("ems-control: created tenant %r", access_id)
        if body.issue_key:
            out["key"] = service.issue(access_id, KEY_DEFAULT)
        return out

    # keys first: {access_id:path} would take ".../keys" as part of an id
    @app.post("/v1/tenants/{access_id:path}/keys/{kid}/rotate", dependencies=a,
              status_code=201, tags=["keys"])
    def rotate_key(access_id: str, kid: str, body: Optional[KeyIn] = None) -> dict[str, Any]:
        length = body.length if body is not None else KEY_DEFAULT
        return service.issue(access_id, length, revoke=kid)

    @app.delete("/v1/tenants/{access_id:path}/keys/{kid}", dependencies=a, tags=["keys"])
    def revoke_key(access_id: str, kid: str) -> dict[str, Any]:
        service.db.revoke_key(access_id, kid)
        logger.info("ems-control: revoked key %s of %r", kid, access_id)
        return {"access_id": access_id, "key_id": kid, "revoked": True}

    @app.get("/v1/tenants/{access_id:path}/keys", dependencies=a, tags=["keys"])
    def list_keys(access_id: str) -> list[dict[str, Any]]:
        return service.db.keys(access_id)

    @app.post("/v1/tenants/{access_id:path}/keys", dependencies=a, status_code=201,
              tags=["keys"])
    def issue_key(access_id: str, body: Optional[KeyIn] = None) -> dict[str, Any]:
        return service.issue(access_id, (body.length if body is not None else KEY_DEFAULT))

    @app.put("/v1/tenants/{access_id:path}/quota", dependencies=a, tags=["quotas"])
    def set_quota(access_id: str, body: QuotaIn) -> dict[str, Any]:
        out = service.db.set_quota(access_id, service.quota(body.quota))
        logger.info("ems-control: quota of %r set to %s", access_id, out["quota_bytes"])
        return out

    @app.get("/v1/tenants/{access_id:path}", dependencies=a, tags=["tenants"])
    def show_tenant(access_id: str) -> dict[str, Any]:
        out = service.db.tenant(access_id)
        out["keys"] = service.db.keys(access_id)
        return out

    @app.delete("/v1/tenants/{access_id:path}", dependencies=a, tags=["tenants"])
    def delete_tenant(access_id: str) -> dict[str, Any]:
        service.db.delete_tenant(access_id)
        logger.info("ems-control: deleted tenant %r", access_id)
        return {"access_id": access_id, "deleted": True}

    # ---------------------------------------------------------------- state
    @app.get("/v1/hosts", dependencies=a, tags=["state"])
    def list_hosts() -> dict[str, Any]:
        """Pool state per host and tenant, as each daemon last reported it."""
        return {"revision": service.db.revision(), "tenants": service.db.tenants(),
                "hosts": service.hosts()}

    @app.get("/v1/pool", dependencies=a, tags=["state"])
    def pool_state() -> list[dict[str, Any]]:
        """One row per host and tenant: capacity, used, objects, hit rates per tier."""
        rows = []
        for h in service.hosts():
            report = DaemonReport.from_wire(h["report"])
            for name, t in sorted(report.tenants.items()):
                rows.append({"host": h["host"], "tenant": name, "age_s": h["age_s"],
                             **_pool_row(t)})
        return rows

    @app.delete("/v1/hosts/{host:path}", dependencies=a, tags=["state"])
    def forget_host(host: str) -> dict[str, Any]:
        """Forget a host's report (a daemon that is gone for good)."""
        if not service.db.delete_report(host):
            raise NotFound(f"no report from host {host!r}")
        return {"host": host, "deleted": True}

    @app.get("/v1/hosts/{host:path}", dependencies=a, tags=["state"])
    def show_host(host: str) -> dict[str, Any]:
        for row in service.hosts():
            if row["host"] == host:
                return row
        raise NotFound(f"no report from host {host!r}")

    # ---------------------------------------------------------------- daemons
    d = [Depends(daemon)]

    @app.get("/v1/registry", dependencies=d, tags=["daemons"])
    def registry(known: Optional[int] = None) -> dict[str, Any]:
        """The registry; ``known``: the revision the daemon has, answered with
        ``{"revision", "unchanged": true}`` while it is current (no key is unsealed)."""
        if known is not None and known == service.db.revision():
            return {"revision": known, "unchanged": True}
        return service.registry()

    @app.post("/v1/hosts/{host:path}/report", dependencies=d, status_code=204,
              tags=["daemons"])
    async def report(host: str, request: Request) -> None:
        body = await request.body()
        if len(body) > _MAX_REPORT_BYTES:
            raise invalid(f"report of {len(body)} bytes, more than {_MAX_REPORT_BYTES}")
        try:
            data = json.loads(body)
        except ValueError:
            raise invalid("report must be a JSON object") from None
        if not isinstance(data, dict) or not host or len(host) > 255:
            raise invalid("report must be a JSON object, host 1-255 characters")
        DaemonReport.from_wire(data)  # a daemon's report, or EMS_PROTOCOL_ERROR (400)
        service.db.put_report(host, data)

    # ---------------------------------------------------------------- page
    @app.get("/healthz", tags=["page"])
    def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
