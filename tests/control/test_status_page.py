"""The status page in a real browser: Debian's headless Chromium loads ``/`` of a
running ems-control whose daemon reported a known workload, runs the page's script,
and the test reads the numbers it rendered from the DOM. The screenshot of the same
page goes to ``$EMS_STATUS_SCREENSHOT`` when set (docs/status-page.png is one)."""

from __future__ import annotations

import html.parser
import os
import shutil
import signal
import subprocess

import pytest
from support.control_support import connect_when_registered, wait_for
from support.itest_support import transport_load, transport_save

from ems.keys import v0_storage_keys as storage

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SIZE = 64 << 10


class _Cells(html.parser.HTMLParser):
    """Text of every element with an id or a data-field, by (host, tenant, field)."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple, str] = {}
        self._open: list = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        key = None
        if "data-field" in a:
            key = (a.get("data-host"), a.get("data-tenant"), a["data-field"])
        elif "id" in a:
            key = ("#", a["id"])
        self._open.append([key, ""])

    def handle_endtag(self, tag):
        if self._open:
            key, text = self._open.pop()
            if key is not None:
                self.cells[key] = text.strip()
            if self._open:
                self._open[-1][1] += text

    def handle_data(self, data):
        if self._open:
            self._open[-1][1] += data


def chromium(tmp_path, url: str, *args: str) -> str:
    """Run headless Chromium on ``url`` (its own profile dir; the whole process group
    is killed by its PID if it overruns); its stdout."""
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}",
         "--virtual-time-budget=4000", *args, url],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"chromium exited {proc.returncode}"
    return out


def dom(tmp_path, url: str) -> dict:
    parser = _Cells()
    parser.feed(chromium(tmp_path, url, "--dump-dom"))
    return parser.cells


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (scripts/setup-chromium.sh "
                                             "needs root and apt)")
def test_status_page_renders_the_reported_numbers(tmp_path, control, daemons):
    server = daemons.start(control, "host-1")
    _, t = control.call("POST", "/v1/tenants", {"access_id": "team-a", "quota": "16M",
                                                "issue_key": True})
    key = t["key"]["access_key"]
    control.call("POST", "/v1/tenants", {"access_id": "team-b", "quota": "8M"})

    tr = connect_when_registered(server, "team-a", key)
    try:
        keys = storage([f"s{i}" for i in range(6)])
        assert transport_save(tr, keys, SIZE) == 6
        assert transport_load(tr, keys, SIZE)[0] == 6  # 6 hits
        assert transport_load(tr, storage(["nope"]), SIZE)[0] == 0  # 1 miss
        assert transport_load(tr, storage(["nope2"]), SIZE)[0] == 0  # 2 misses

        def reported():
            hosts = control.call("GET", "/v1/hosts")[1]["hosts"]
            rows = [h["report"]["tenants"].get("team-a", {}) for h in hosts]
            return rows and rows[0].get("hits") == 6 and rows[0].get("misses") == 2 and \
                rows[0].get("connections") == 1
        wait_for(reported, 5.0, "the daemon's report")
        url = f"{control.url}/#token={control.token('admin')}"
        cells = dom(tmp_path, url)
        assert cells[("#", "state")] == "live"
        assert cells[("#", "sum-hosts")] == "1 / 1"
        assert cells[("#", "sum-tenants")] == "2"
        assert cells[("#", "sum-capacity")] == "24.0 MiB"  # 16M + 8M on host-1
        assert cells[("#", "sum-hit-rate-local")] == "75.0%"  # 6 of 8
        assert cells[("host-1", None, "state")] == "up"
        assert cells[("host-1", None, "hit-rate-local")] == "75.0%"
        assert cells[("host-1", None, "objects")] == "6"
        assert cells[(None, "team-a", "quota")] == "16.0 MiB"
        assert cells[(None, "team-a", "hits")] == "6"
        assert cells[(None, "team-a", "misses")] == "2"
        assert cells[(None, "team-a", "hit-rate-cluster")] == "-"
        assert cells[(None, "team-b", "hit-rate-local")] == "-"  # no lookups yet
        assert cells[("host-1", "team-a", "misses")] == "2 (2 / 0 / 0)"
        assert cells[("host-1", "team-a", "connections")] == "1"
        assert cells[("host-1", "team-a", "hit-rate-local")] == "75.0%"  # the row's hit_rate
        shot = tmp_path / "status.png"
        chromium(tmp_path, url, "--hide-scrollbars", "--window-size=1280,820",
                 f"--screenshot={shot}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("EMS_STATUS_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["EMS_STATUS_SCREENSHOT"])
        # A report in the format the cluster tier will send (tiers.cluster), posted
        # through the real daemon endpoint: the page shows that tier's hit rate too.
        row = dict(control.call("GET", "/v1/hosts/host-1")[1]["report"]["tenants"]["team-a"])
        row["tiers"] = dict(row["tiers"], cluster={"hits": 3, "misses": 1, "hit_rate": 0.75})
        assert control.call("POST", "/v1/hosts/host-x/report", token="daemon", body={
            "server": {"pid": 1, "connections": 0}, "tenants": {"team-a": row},
            "control": {"revision": 3}})[0] == 204
        cells = dom(tmp_path, url)
        assert cells[("#", "sum-hosts")] == "2 / 2"
        assert cells[("host-x", None, "hit-rate-cluster")] == "75.0%"
        assert cells[("host-1", None, "hit-rate-cluster")] == "-"
        assert cells[(None, "team-a", "hit-rate-cluster")] == "75.0%"
        assert cells[(None, "team-a", "hosts")] == "2"
        assert control.call("DELETE", "/v1/hosts/host-x")[0] == 200
    finally:
        tr.close()
    # without the token, or with a wrong one, the page shows no data
    cells = dom(tmp_path, control.url + "/")
    assert cells[("#", "state")] == "admin token needed" and ("#", "sum-hosts") not in cells
    cells = dom(tmp_path, control.url + "/#token=wrong-token")
    assert cells[("#", "state")] == "token refused"
