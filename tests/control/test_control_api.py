"""The REST API and the CLI against a real ems-control (SQLite on disk)."""

from __future__ import annotations

import json
import re

import pytest

from ems.control.cli import keys_main, quota_main, tenants_main
from ems.control.client import http_json

pytestmark = pytest.mark.integration

ADMIN_PATHS = [("GET", "/v1/tenants"), ("POST", "/v1/tenants"), ("GET", "/v1/tenants/t"),
               ("DELETE", "/v1/tenants/t"), ("GET", "/v1/tenants/t/keys"),
               ("POST", "/v1/tenants/t/keys"), ("POST", "/v1/tenants/t/keys/k/rotate"),
               ("DELETE", "/v1/tenants/t/keys/k"), ("PUT", "/v1/tenants/t/quota"),
               ("GET", "/v1/hosts")]


def test_admin_and_daemon_endpoints_refuse_missing_and_wrong_tokens(control):
    body = {"access_id": "t", "quota": None}
    for method, path in ADMIN_PATHS:
        for token in (None, "wrong-token-0123456789", control.token("daemon")):
            status, data = http_json(method, control.url + path, token, body)
            assert status == 401, (method, path, token, status, data)
    for method, path in (("GET", "/v1/registry"), ("POST", "/v1/hosts/h/report")):
        for token in (None, "wrong", control.token("admin")):
            assert http_json(method, control.url + path, token, {})[0] == 401
    status, _ = http_json("GET", control.url + "/v1/tenants", control.token("admin"))
    assert status == 200
    assert control.call("GET", "/v1/tenants")[1] == []  # nothing was created


def test_tenant_key_and_quota_lifecycle(control):
    status, t = control.call("POST", "/v1/tenants", {"access_id": "team-a", "quota": "64M"})
    assert status == 201 and t["quota_bytes"] == 64 << 20 and t["active_keys"] == 0
    assert control.call("POST", "/v1/tenants", {"access_id": "team-a"})[0] == 409
    status, k1 = control.call("POST", "/v1/tenants/team-a/keys", {"length": 48})
    assert status == 201 and re.fullmatch(r"[0-9A-Za-z+/=]{48}", k1["access_key"])
    status, keys = control.call("GET", "/v1/tenants/team-a/keys")
    assert [k["key_id"] for k in keys] == [k1["key_id"]]
    assert k1["access_key"] not in json.dumps(keys)  # listed without secrets
    status, k2 = control.call("POST", f"/v1/tenants/team-a/keys/{k1['key_id']}/rotate")
    assert status == 201 and k2["revoked"] == k1["key_id"] and len(k2["access_key"]) == 64
    status, shown = control.call("GET", "/v1/tenants/team-a")
    assert shown["active_keys"] == 1 and k2["access_key"] not in json.dumps(shown)
    assert [(k["key_id"], k["active"]) for k in shown["keys"]] == [
        (k1["key_id"], False), (k2["key_id"], True)]
    assert control.call("DELETE", f"/v1/tenants/team-a/keys/{k1['key_id']}")[0] == 409
    assert control.call("DELETE", f"/v1/tenants/team-a/keys/{k2['key_id']}")[0] == 200
    assert control.call("PUT", "/v1/tenants/team-a/quota", {"quota": 2 << 30})[1][
        "quota_bytes"] == 2 << 30
    assert control.call("PUT", "/v1/tenants/team-a/quota", {"quota": None})[1][
        "quota_bytes"] is None
    status, reg = control.call("GET", "/v1/registry", token="daemon")
    assert reg["tenants"] == [{"access_id": "team-a", "quota_bytes": 256 << 20, "keys": []}]
    rev = reg["revision"]  # a daemon that is current gets no keys again
    assert control.call("GET", f"/v1/registry?known={rev}", token="daemon")[1] == {
        "revision": rev, "unchanged": True}
    assert control.call("GET", f"/v1/registry?known={rev - 1}", token="daemon")[1] == reg
    assert control.call("DELETE", "/v1/tenants/team-a")[0] == 200
    assert control.call("GET", "/v1/tenants/team-a")[0] == 404
    assert control.call("DELETE", "/v1/tenants/team-a")[0] == 404


@pytest.mark.parametrize("body, field", [
    ({"access_id": "bad\nid"}, "access_id"),
    ({"access_id": "org/keys"}, "access_id"),               # names a sub-resource
    ({"access_id": ""}, "access_id"),
    ({"access_id": "x" * 600}, "access_id"),
    ({"access_id": "ok", "quota": "12Q"}, "quota"),
    ({"access_id": "ok", "quota": 1024}, "quota"),          # under 1 MiB
    ({"access_id": "ok", "quota": "2T"}, "quota"),          # over max_quota (1 TiB)
])
def test_bad_input_is_refused_with_the_field_named_and_changes_nothing(control, body, field):
    status, data = control.call("POST", "/v1/tenants", body)
    assert status == 400 and field in data["detail"], data
    assert data["code"] == "EMS_INVALID_ARGUMENT"
    assert control.call("GET", "/v1/tenants")[1] == []


def test_ids_of_real_deployments_work_in_paths(control):
    ident = "org/Model-7B:v2@svc"  # '/', ':', '@' and upper case: the SDK's rule
    assert control.call("POST", "/v1/tenants", {"access_id": ident})[0] == 201
    status, key = control.call("POST", f"/v1/tenants/{ident}/keys")
    assert status == 201 and key["access_id"] == ident
    assert control.call("GET", f"/v1/tenants/{ident}")[1]["active_keys"] == 1
    assert control.call("PUT", f"/v1/tenants/{ident}/quota", {"quota": "1G"})[0] == 200
    assert control.call("DELETE", f"/v1/tenants/{ident}/keys/{key['key_id']}")[0] == 200
    assert control.call("DELETE", f"/v1/tenants/{ident}")[0] == 200


def test_key_length_out_of_range_is_refused(control):
    control.call("POST", "/v1/tenants", {"access_id": "team-a"})
    for length in (31, 257):
        status, data = control.call("POST", "/v1/tenants/team-a/keys", {"length": length})
        assert status == 422 and "length" in json.dumps(data)
    assert control.call("GET", "/v1/tenants/team-a/keys")[1] == []


def test_openapi_docs_and_page_are_served(control):
    status, spec = http_json("GET", control.url + "/openapi.json")
    assert status == 200 and spec["info"]["title"] == "ems-control"
    assert {"/v1/tenants", "/v1/registry", "/v1/hosts"} <= set(spec["paths"])
    import urllib.request
    with urllib.request.urlopen(control.url + "/docs", timeout=5) as r:
        assert b"swagger" in r.read().lower()
    with urllib.request.urlopen(control.url + "/", timeout=5) as r:
        assert b"/static/status.js" in r.read()


def test_the_database_survives_a_restart_of_the_service(control):
    control.call("POST", "/v1/tenants", {"access_id": "team-a", "issue_key": True})
    rev = control.call("GET", "/v1/hosts")[1]["revision"]
    control.stop()
    control.start()
    assert [t["access_id"] for t in control.call("GET", "/v1/tenants")[1]] == ["team-a"]
    status, reg = control.call("GET", "/v1/registry", token="daemon")
    assert reg["revision"] == rev and len(reg["tenants"][0]["keys"]) == 1


def test_cli_drives_the_api(control, capsys):
    common = ["--url", control.url, "--token-file", control.token_file("admin")]
    assert tenants_main(["create", "team-a", "--quota", "32M", *common]) == 0
    assert "team-a created, quota 32.0 MiB" in capsys.readouterr().out
    assert keys_main(["issue", "team-a", "--json", *common]) == 0
    issued = json.loads(capsys.readouterr().out)
    assert len(issued["access_key"]) == 64
    assert keys_main(["list", "team-a", *common]) == 0
    out = capsys.readouterr().out
    assert issued["key_id"] in out and issued["access_key"] not in out
    assert keys_main(["rotate", "team-a", issued["key_id"], "--json", *common]) == 0
    rotated = json.loads(capsys.readouterr().out)
    assert rotated["revoked"] == issued["key_id"]
    assert keys_main(["revoke", "team-a", rotated["key_id"], *common]) == 0
    assert "revoked" in capsys.readouterr().out
    assert quota_main(["set", "team-a", "1G", "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)["quota_bytes"] == 1 << 30
    assert tenants_main(["list", "--json", *common]) == 0
    assert [t["access_id"] for t in json.loads(capsys.readouterr().out)] == ["team-a"]
    assert tenants_main(["delete", "team-a", *common]) == 0
    capsys.readouterr()
    # refusals: exit 1 with the reason, nothing printed on stdout
    assert tenants_main(["delete", "team-a", *common]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert tenants_main(["list", "--url", control.url, "--token-file",
                         control.token_file("daemon")]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert tenants_main(["list", "--url", "http://127.0.0.1:1", *common[2:]]) == 1
    assert "unreachable" in capsys.readouterr().err
