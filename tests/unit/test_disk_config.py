"""The disk tier's settings: flags, environment and the ``[disk]`` table merge as the
daemon's other settings do (file < environment < flags); bad values are refused with a
message naming the field."""

from __future__ import annotations

import pytest

from ems.errors import EmsErrorCode, EmsException
from ems.server.config import ServerConfig


def _load(flags=None, env=None, toml: str = "", tmp_path=None) -> ServerConfig:
    flags = dict(flags or {})
    if toml:
        path = tmp_path / "ems.toml"
        path.write_text(toml)
        flags["config"] = str(path)
    return ServerConfig.load(flags, env or {})


def test_off_by_default():
    assert _load().disk is None


def test_file_then_environment_then_flags(tmp_path):
    cfg = _load(toml='[disk]\npath = "/f"\ncapacity = "1G"\ncheckpoint_s = 5\n'
                     'admission = "second-hit"\nwrite_budget = "2T"\nflush_on_stop_s = 3\n'
                     'io_threads = 6\ninflight = "16M"\nqueue = "256M"\n'
                     '[disk.quotas]\n"team-a" = "512M"\n', tmp_path=tmp_path)
    d = cfg.disk
    assert (d.path, d.capacity_bytes, d.checkpoint_s, d.admission) == (
        "/f", 1 << 30, 5.0, "second-hit")
    assert (d.write_budget_bytes_per_day, d.flush_on_stop_s, d.io_threads, d.inflight_bytes,
            d.queue_bytes) == (2 << 40, 3.0, 6, 16 << 20, 256 << 20)
    assert d.quotas_bytes == {"team-a": 512 << 20}
    cfg = _load(env={"EMS_DISK": "/e", "EMS_DISK_CAPACITY": "2G",
                     "EMS_DISK_CHECKPOINT_S": "7"},
                toml='[disk]\npath = "/f"\n', tmp_path=tmp_path)
    assert (cfg.disk.path, cfg.disk.capacity_bytes, cfg.disk.checkpoint_s) == (
        "/e", 2 << 30, 7.0)
    cfg = _load(flags={"disk": "/x", "disk_capacity": "3G", "disk_checkpoint_s": "1.5",
                       "disk_admission": "all"},
                env={"EMS_DISK": "/e", "EMS_DISK_CAPACITY": "2G"})
    assert (cfg.disk.path, cfg.disk.capacity_bytes, cfg.disk.checkpoint_s,
            cfg.disk.admission) == ("/x", 3 << 30, 1.5, "all")


@pytest.mark.parametrize("toml, names", [
    ('[disk]\ncapacity = "1G"\n', "path"),
    ('[disk]\npath = "/d"\ncapacity = "-1"\n', "disk.capacity"),
    ('[disk]\npath = "/d"\ncheckpoint_s = 0\n', "disk.checkpoint_s"),
    ('[disk]\npath = "/d"\nadmission = "sometimes"\n', "disk.admission"),
    ('[disk]\npath = "/d"\nio_threads = 0\n', "disk.io_threads"),
    ('[disk]\npath = "/d"\nbogus = 1\n', "bogus"),
    ('[disk]\npath = "/d"\nwrite_buffer = 5000\n', "disk.write_buffer"),
    ('[disk]\npath = "/d"\n[disk.quotas]\n"team-a" = "lots"\n', "disk.quotas.team-a"),
    ('disk = "/d"\n', "disk must be a table"),
])
def test_bad_values_are_refused_naming_the_field(tmp_path, toml, names):
    with pytest.raises(EmsException) as err:
        _load(toml=toml, tmp_path=tmp_path)
    assert err.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert names in err.value.message()
