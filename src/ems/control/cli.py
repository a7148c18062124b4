"""``ems tenants|keys|quota``: the REST API of ems-control from a shell.

::

    ems tenants create team-a --quota 8G [--issue-key]   ems keys issue team-a
    ems tenants list | show ID | delete ID               ems keys list team-a
    ems quota set team-a 16G   (or: default)             ems keys rotate team-a KEY_ID
                                                         ems keys revoke team-a KEY_ID

The service is ``--url`` (env ``EMS_CONTROL``, default ``http://127.0.0.1:8470``);
the admin token comes from ``--token-file`` (env ``EMS_CONTROL_ADMIN_TOKEN_FILE``),
else the env ``EMS_CONTROL_ADMIN_TOKEN``, else the service's default
``~/.local/state/ems-control/admin.token``. ``--json`` prints the API's answer as is.
Exit status: 0 done, 1 refused or unreachable (the message says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import urllib.error
import urllib.parse
from typing import Any, Callable, Optional, Sequence

from ems.control.client import http_json
from ems.errors import EmsException
from ems.settings import Layer, Number, Text, add_flags, load, setting

__all__ = ["keys_main", "quota_main", "tenants_main"]

DEFAULT_URL = "http://127.0.0.1:8470"


@dataclasses.dataclass(frozen=True)
class ShellConfig:
    """Where the shell commands find the service and its admin token, each setting
    declared once (defaults < environment < flags, merged by :func:`ems.settings.load`;
    the table in docs/control-plane.md is generated from it)."""

    url: str = setting("the ems-control service", Text(), default=DEFAULT_URL, key=None,
                       env="EMS_CONTROL", flag="--url", metavar="URL")
    token_file: Optional[str] = setting(
        "admin token file", Text(),
        default=None, key=None, env="EMS_CONTROL_ADMIN_TOKEN_FILE", flag="--token-file",
        metavar="FILE", shown="STATE_DIR/admin.token")
    token: Optional[str] = setting(
        "the admin token itself, when no token file is given (never a flag: ps shows "
        "those)", Text(), default=None, key=None, env="EMS_CONTROL_ADMIN_TOKEN", repr=False)
    timeout_s: float = setting("give up on a request after this long (seconds)",
                               Number(0.0, open_low=True), default=10.0, key=None,
                               flag="--timeout-s", metavar="S")


def _common(p: argparse.ArgumentParser) -> None:
    add_flags(p, ShellConfig)
    p.add_argument("--json", action="store_true", help="print the answer as JSON")


def _config(args: argparse.Namespace) -> ShellConfig:
    return load(ShellConfig, [Layer.environ(os.environ), Layer.flags(vars(args))])


def _token(config: ShellConfig) -> str:
    path = config.token_file
    if not path and config.token:
        return config.token.strip()
    if not path:
        from ems.control.config import ControlConfig
        path = ControlConfig().file("admin.token")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        raise _Fail(f"cannot read the admin token file {path}: {exc.strerror} (give "
                    f"--token-file or EMS_CONTROL_ADMIN_TOKEN)") from exc


class _Fail(Exception):
    pass


def _q(access_id: str) -> str:
    return urllib.parse.quote(access_id, safe="/@:")


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    config = _config(args)
    url = config.url.rstrip("/")
    try:
        status, data = http_json(method, url + path, _token(config), body, config.timeout_s)
    except (urllib.error.URLError, OSError) as exc:
        raise _Fail(f"{url} is unreachable: {getattr(exc, 'reason', exc)}") from exc
    if status >= 400:
        detail = data.get("detail") if isinstance(data, dict) else data
        raise _Fail(f"{method} {path}: HTTP {status}: {detail}")
    return data


def _size(n: Optional[int]) -> str:
    if n is None:
        return "default"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _when(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + "Z"


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _print_key(key: dict[str, Any]) -> str:
    return (f"key {key['key_id']} of {key['access_id']}"
            f"{' (revoked ' + key['revoked'] + ')' if key.get('revoked') else ''}:\n"
            f"  access_key = {key['access_key']}\n"
            f"  (shown once: store it now; ems-control keeps it sealed)")


def _run(prog: str, build: Callable[[argparse.ArgumentParser], None],
         argv: Optional[Sequence[str]]) -> int:
    parser = argparse.ArgumentParser(prog=prog)
    build(parser)
    args = parser.parse_args(argv)
    try:
        _config(args)
    except EmsException as exc:  # a bad --url / --timeout-s / variable: usage
        parser.error(exc.message())
    try:
        data, text = args.func(args)
    except _Fail as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)
    return 0


# ---------------------------------------------------------------- tenants
def _tenants(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", help="create a tenant")
    c.add_argument("access_id")
    c.add_argument("--quota", help="pool size on each daemon, e.g. 8G (default: the "
                                   "service's default quota)")
    c.add_argument("--issue-key", action="store_true", help="also issue its first key")
    c.set_defaults(func=_tenants_create)
    lst = sub.add_parser("list", help="list tenants")
    lst.set_defaults(func=_tenants_list)
    s = sub.add_parser("show", help="one tenant and its keys")
    s.add_argument("access_id")
    s.set_defaults(func=_tenants_show)
    d = sub.add_parser("delete", help="delete a tenant (its sessions are closed)")
    d.add_argument("access_id")
    d.set_defaults(func=_tenants_delete)
    for sp in (c, lst, s, d):
        _common(sp)


def _tenants_create(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "POST", "/v1/tenants", {"access_id": args.access_id,
                                               "quota": args.quota,
                                               "issue_key": args.issue_key})
    text = f"tenant {data['access_id']} created, quota {_size(data['quota_bytes'])}"
    if "key" in data:
        text += "\n" + _print_key(data["key"])
    return data, text


def _tenants_list(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "GET", "/v1/tenants")
    rows = [("access_id", "quota", "active keys")]
    rows += [(t["access_id"], _size(t["quota_bytes"]), str(t["active_keys"])) for t in data]
    return data, _table(rows) if data else "no tenants"


def _tenants_show(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "GET", f"/v1/tenants/{_q(args.access_id)}")
    text = f"tenant {data['access_id']}: quota {_size(data['quota_bytes'])}"
    return data, text + "\n" + _keys_table(data["keys"])


def _tenants_delete(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "DELETE", f"/v1/tenants/{_q(args.access_id)}")
    return data, f"tenant {args.access_id} deleted"


# ---------------------------------------------------------------- keys
def _keys(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    i = sub.add_parser("issue", help="issue a new access key (printed once)")
    i.add_argument("access_id")
    i.add_argument("--length", type=int, default=64, help="characters (32-256, default 64)")
    i.set_defaults(func=_keys_issue)
    lst = sub.add_parser("list", help="a tenant's keys (no secrets)")
    lst.add_argument("access_id")
    lst.set_defaults(func=_keys_list)
    r = sub.add_parser("rotate", help="issue a new key and revoke KEY_ID in one step")
    r.add_argument("access_id")
    r.add_argument("key_id")
    r.add_argument("--length", type=int, default=64)
    r.set_defaults(func=_keys_rotate)
    v = sub.add_parser("revoke", help="revoke a key (its sessions are closed)")
    v.add_argument("access_id")
    v.add_argument("key_id")
    v.set_defaults(func=_keys_revoke)
    for sp in (i, lst, r, v):
        _common(sp)


def _keys_table(keys: list[dict[str, Any]]) -> str:
    if not keys:
        return "no keys"
    rows = [("key_id", "state", "created", "revoked")]
    rows += [(k["key_id"], "active" if k["active"] else "revoked", _when(k["created_at"]),
              _when(k["revoked_at"])) for k in keys]
    return _table(rows)


def _keys_issue(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "POST", f"/v1/tenants/{_q(args.access_id)}/keys",
                 {"length": args.length})
    return data, _print_key(data)


def _keys_list(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "GET", f"/v1/tenants/{_q(args.access_id)}/keys")
    return data, _keys_table(data)


def _keys_rotate(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "POST", f"/v1/tenants/{_q(args.access_id)}/keys/"
                               f"{_q(args.key_id)}/rotate", {"length": args.length})
    return data, _print_key(data)


def _keys_revoke(args: argparse.Namespace) -> tuple[Any, str]:
    data = _call(args, "DELETE", f"/v1/tenants/{_q(args.access_id)}/keys/{_q(args.key_id)}")
    return data, f"key {args.key_id} of {args.access_id} revoked"


# ---------------------------------------------------------------- quota
def _quota(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("set", help="change a tenant's quota (live on every daemon)")
    s.add_argument("access_id")
    s.add_argument("size", help="e.g. 16G, or 'default'")
    s.set_defaults(func=_quota_set)
    _common(s)


def _quota_set(args: argparse.Namespace) -> tuple[Any, str]:
    size = None if args.size == "default" else args.size
    data = _call(args, "PUT", f"/v1/tenants/{_q(args.access_id)}/quota", {"quota": size})
    return data, f"quota of {data['access_id']}: {_size(data['quota_bytes'])}"


def tenants_main(argv: Optional[Sequence[str]] = None) -> int:
    return _run("ems tenants", _tenants, argv)


def keys_main(argv: Optional[Sequence[str]] = None) -> int:
    return _run("ems keys", _keys, argv)


def quota_main(argv: Optional[Sequence[str]] = None) -> int:
    return _run("ems quota", _quota, argv)
