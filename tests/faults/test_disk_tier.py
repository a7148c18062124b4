"""The disk tier of real daemons on real files (``ems-server --disk DIR``).

Values are a pure function of their key (``client_worker.pattern``), so every hit is
checked byte for byte: a wrong byte anywhere fails the test. Daemons and client
processes are stopped by PID at teardown (the integration fixtures); tmpfs mounts are
unmounted in ``finally``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
from support.client_worker import Value, pattern
from support.itest_support import KEY_A, KEY_B, anonymous_stats_when, wait_for

from ems import CcConfig, CcKvOption, Ems, EmsConfig

pytestmark = pytest.mark.integration

MIB = 1 << 20


def _disk(server) -> dict:
    return server.stats()["disk"]


def _settled(server, objects: int, timeout_s: float = 30.0) -> dict:
    """Wait until the disk holds ``objects`` records and no write waits or runs."""
    def check():
        d = _disk(server)
        return d if (d["objects"] >= objects and not d["queued_write_bytes"]
                     and not d["inflight_write_bytes"]) else None
    return wait_for(check, timeout_s, f"{objects} objects on disk")


def _recovered(server, timeout_s: float = 20.0) -> dict:
    """The disk report once the start's recovery has ended (it runs on a thread of its
    own: a report right after a start may still say ``recovering``, none found yet)."""
    server.disk_after_recovery(timeout_s)
    return _disk(server)


def _checkpointed(server, timeout_s: float = 20.0) -> None:
    """Wait for two more checkpoints (the second began after everything before it)."""
    start = _disk(server)["checkpoints"]
    wait_for(lambda: _disk(server)["checkpoints"] >= start + 2, timeout_s, "a checkpoint")


def _batches(keys, n):
    return [keys[i:i + n] for i in range(0, len(keys), n)]


def _disk_args(tmp_path, *more: str, checkpoint_s: str = "0.2") -> list[str]:
    return ["--disk", str(tmp_path / "disk"), "--disk-checkpoint-s", checkpoint_s, *more]


def test_spill_and_load_back_beyond_shared_memory(make_server, workers, tmp_path, figures):
    server = make_server(capacity="16M", extra_args=_disk_args(tmp_path))
    keys = [f"spill-{i}" for i in range(64)]  # 64 MiB through a 16 MiB pool
    for batch in _batches(keys, 8):
        assert workers.run(server, "save", keys=batch, size=MIB) == {"success": 8}
    _settled(server, 64)
    for batch in _batches(keys, 8):
        assert workers.run(server, "load", keys=batch, size=MIB) == {"success": 8, "wrong": 0}
    row = server.stats()["tenants"]["(anonymous)"]
    assert row["evictions"] > 0 and row["tiers"]["disk"]["hits"] >= 48
    d = _disk(server)
    assert d["objects"] == 64 and d["read_damaged"] == 0
    figures["disk_hits"] = row["tiers"]["disk"]["hits"]


def test_sigterm_then_restart_finds_everything(make_server, workers, tmp_path):
    server = make_server(capacity="32M", extra_args=_disk_args(tmp_path, checkpoint_s="60"))
    keys = [f"term-{i}" for i in range(24)]
    for batch in _batches(keys, 8):
        assert workers.run(server, "save", keys=batch, size=256 << 10)["success"] == 8
    server.stop()  # SIGTERM: flush, checkpoint, clean marker (no checkpoint ran before)
    server.start()
    d = _recovered(server)
    assert d["records_recovered"] == 24 and d["scan_skipped"]
    got = workers.run(server, "load", keys=keys, size=256 << 10)
    assert got == {"success": 24, "wrong": 0}


def _values(keys, size):
    return [Value(size, pattern(k, size)) for k in keys]


def _load_checked(cc, keys, size, timeout_ms=10000, batch=32) -> tuple[int, int]:
    """(hits, wrong bytes among them) of loads of ``keys`` in this process, in batches
    that fit the pool (a load pins its hits in shared memory)."""
    hits = wrong = 0
    for part in _batches(keys, batch):
        out = [Value(size) for _ in part]
        res = cc.load(CcKvOption(timeout=timeout_ms), part, [v.wrappers() for v in out])
        hits += res.success
        wrong += sum(1 for k, v in zip(part[:res.success], out)
                     if v.bytes() != pattern(k, size))
    return hits, wrong


@pytest.mark.slow
def test_kill_9_in_the_middle_of_saves_never_serves_a_wrong_byte(make_server, client_env,
                                                                  tmp_path, figures):
    """A loop of kill -9 at random moments while saves are in flight, each followed by
    a restart: every key checkpointed before the kill is found, every hit is exact."""
    loops = int(os.environ.get("EMS_KILL_LOOPS", "50"))
    rng = random.Random(1234)
    server = make_server(capacity="8M", extra_args=_disk_args(tmp_path, checkpoint_s="0.05"))
    client_env(server)
    config = EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="itest"))
    size = 64 << 10
    durable: list[str] = []
    found = wrong = hits_in_flight = 0
    started = time.monotonic()
    try:
        for i in range(loops):
            Ems.init(config)
            cc = Ems.get_cc()
            keys = [f"kill-{i}-{j}" for j in range(4)]
            vals = _values(keys, size)
            assert cc.save(CcKvOption(timeout=10000), keys,
                           [v.wrappers() for v in vals]).success == 4
            _settled(server, len(durable) + 4)
            _checkpointed(server)
            durable += keys
            flight = [f"flight-{i}-{j}" for j in range(64)]  # saves in flight at the kill
            fvals = _values(flight, size)
            futures = [cc.async_save(CcKvOption(timeout=5000), flight[j:j + 8],
                                     [v.wrappers() for v in fvals[j:j + 8]])
                       for j in range(0, 64, 8)]
            time.sleep(rng.uniform(0.0, 0.15))
            server.kill()
            for f in futures:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - the daemon died under it
                    pass
            Ems.finalize()
            server.start()
            Ems.init(config)
            cc = Ems.get_cc()
            hits, bad = _load_checked(cc, durable, size)
            assert (hits, bad) == (len(durable), 0), (i, hits, bad)
            found += hits
            hits, bad = _load_checked(cc, flight, size)  # whatever made it
            hits_in_flight += hits
            wrong += bad
            assert bad == 0
            Ems.finalize()
    finally:
        Ems.finalize()
    figures.update(loops=loops, checkpointed_found=found, wrong=wrong,
                   in_flight_hits=hits_in_flight,
                   seconds=round(time.monotonic() - started, 1),
                   damaged_dropped=_disk(server)["records_dropped_damaged"])


def test_damaged_and_truncated_records_are_misses(make_server, workers, tmp_path):
    server = make_server(capacity="32M", extra_args=_disk_args(tmp_path))
    keys = [f"dmg-{i}" for i in range(32)]
    for batch in _batches(keys, 8):
        assert workers.run(server, "save", keys=batch, size=128 << 10)["success"] == 8
    _settled(server, 32)
    server.stop()
    regions = sorted(os.path.join(root, f) for root, _, files in os.walk(tmp_path / "disk")
                     for f in files if f.endswith(".region"))
    assert regions
    rng = random.Random(7)
    for path in regions:  # flip bytes at random offsets of every region file
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            for _ in range(6):
                at = rng.randrange(size)
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0xFF]))
    with open(regions[0], "r+b") as f:  # and cut one short
        f.truncate(os.path.getsize(regions[0]) // 2)
    os.unlink(tmp_path / "disk" / "clean")  # a crash: the scan runs too
    server.start()
    got = workers.run(server, "load", keys=keys, size=128 << 10)
    assert got["wrong"] == 0 and got["success"] < 32
    hits = 0
    for key in keys:  # one by one: every intact record still loads
        r = workers.run(server, "load", keys=[key], size=128 << 10)
        assert r["wrong"] == 0
        hits += r["success"]
    d = _disk(server)
    assert hits < 32 and d["read_damaged"] + d["records_dropped_damaged"] > 0
    assert server.running


def test_tenants_stay_apart_on_disk_across_a_restart(make_server, workers, tmp_path):
    server = make_server(capacity="32M", tenants={"team-a": KEY_A, "team-b": KEY_B},
                         anonymous=False, extra_args=_disk_args(tmp_path))
    a = {"access_id": "team-a", "access_key": KEY_A}
    b = {"access_id": "team-b", "access_key": KEY_B}
    keys = [f"shared-name-{i}" for i in range(8)]
    assert workers.run(server, "save", keys=keys, size=MIB, **a)["success"] == 8
    _settled(server, 8)
    server.stop()
    server.start()
    assert workers.run(server, "load", keys=keys, size=MIB, **b) == {"success": 0, "wrong": 0}
    assert workers.run(server, "load", keys=keys, size=MIB, **a) == {"success": 8, "wrong": 0}
    tenant_dirs = [p for p in os.listdir(tmp_path / "disk") if p.startswith("t")]
    assert len(tenant_dirs) == 1  # only team-a wrote
    assert os.stat(tmp_path / "disk").st_mode & 0o777 == 0o700


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                          str(path)], capture_output=True, text=True)
    return run.returncode == 0


def test_a_full_disk_stops_admission_and_saves_still_succeed(make_server, workers, tmp_path):
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "8m"):
        pytest.skip("cannot mount a tmpfs here (needs root): the ENOSPC test skips")
    try:
        server = make_server(capacity="48M", extra_args=["--disk", str(mnt / "disk"),
                                                         "--disk-capacity", "1G"])
        keys = [f"full-{i}" for i in range(32)]
        for batch in _batches(keys, 8):
            assert workers.run(server, "save", keys=batch, size=MIB) == {"success": 8}
        wait_for(lambda: _disk(server)["refused_no_space"] > 0, 30, "ENOSPC counted")
        got = workers.run(server, "load", keys=keys, size=MIB)
        assert got == {"success": 32, "wrong": 0}  # shared memory kept them all
        assert server.running
        server.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_slow_disk_keeps_the_deadline_and_no_byte_arrives_late(make_server, workers,
                                                                 client_env, tmp_path,
                                                                 figures):
    config = tmp_path / "slow.toml"
    server = make_server(capacity="32M", extra_args=_disk_args(tmp_path))
    keys = [f"slow-{i}" for i in range(8)]
    assert workers.run(server, "save", keys=keys, size=MIB)["success"] == 8
    _settled(server, 8)
    server.stop()
    # 4 readers of 2 keys each: every second read ends past the load's deadline
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\nio_delay_ms = 400\n'
                      'io_threads = 4\n')
    server.args += ["--config", str(config)]
    server.args = [a for a in server.args if a not in ("--disk", str(tmp_path / "disk"))]
    server.start()
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="itest")))
    try:
        cc = Ems.get_cc()
        values = [Value(MIB) for _ in keys]
        t0 = time.monotonic()
        res = cc.load(CcKvOption(timeout=600), keys, [v.wrappers() for v in values])
        elapsed = time.monotonic() - t0
        seen = [v.bytes() for v in values]
        # every slowed read has returned once the reservations it read into are given
        # back (a late read keeps its own until then, ``ems.server.tier_driver``)
        anonymous_stats_when(server, lambda s: s["reserved"] == 0, 5.0, "late reads back")
        assert _disk(server)["read_timeouts"] >= 1
        assert [v.bytes() for v in values] == seen  # nothing arrived after the return
        assert elapsed < 0.6 + 0.15, elapsed
        assert res.success < len(keys)
        for k, v in zip(keys[:res.success], values):
            assert v.bytes() == pattern(k, MIB)
        figures.update(timeout_ms=600, returned_after_ms=round(elapsed * 1000, 1),
                       hits=res.success)
    finally:
        Ems.finalize()


def test_a_save_waits_for_the_disk_within_its_own_deadline(make_server, client_env, tmp_path,
                                                           figures):
    """Back-pressure bounded by the save's deadline: shared memory full of objects a
    slow disk has not written, a save of 400 ms waits half of it (not the daemon's
    ``save_wait_ms`` of a minute), then evicts one unwritten object (counted) and is
    stored in time: its Reserve carried what was left of its deadline."""
    config = tmp_path / "slow.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "disk"}"\nio_delay_ms = 1000\n'
                      'io_threads = 1\ninflight = "1M"\nsave_wait_ms = 60000\n')
    server = make_server(capacity="6M", extra_args=["--config", str(config)])
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="itest")))
    try:
        cc = Ems.get_cc()
        for i in range(4):  # one write-out each: the first written (pinned), three queued
            key = f"fill-{i}"
            v = Value(MIB, pattern(key, MIB))
            assert cc.save(CcKvOption(), [key], [v.wrappers()]).success == 1
        keys = [f"late-{i}" for i in range(3)]  # room for two: the third waits
        values = [Value(MIB, pattern(k, MIB)) for k in keys]
        t0 = time.monotonic()
        res = cc.save(CcKvOption(timeout=400, write_out=False), keys,
                      [v.wrappers() for v in values])
        elapsed = time.monotonic() - t0
        assert res.success == 3, res
        assert 0.15 < elapsed < 0.4, elapsed  # waited, and returned by its deadline
        assert _disk(server)["save_waits"] >= 1
        # the evicted one is counted when its write's turn comes (the others written)
        disk = _settled(server, 3)
        assert disk["unwritten"]["evicted_unwritten"] == 1 and disk["objects"] == 3, disk
        figures.update(timeout_ms=400, returned_after_ms=round(elapsed * 1000, 1))
    finally:
        Ems.finalize()


def test_stats_and_metrics_show_the_disk_tier(make_server, workers, tmp_path):
    from support.control_support import free_port, scrape, value

    port = free_port()
    server = make_server(capacity="8M", extra_args=_disk_args(
        tmp_path, "--metrics-addr", f"127.0.0.1:{port}"))
    keys = [f"obs-{i}" for i in range(16)]
    for batch in _batches(keys, 4):
        assert workers.run(server, "save", keys=batch, size=MIB)["success"] == 4
    _settled(server, 16)
    assert workers.run(server, "load", keys=keys[:4], size=MIB) == {"success": 4, "wrong": 0}
    text = subprocess.run([sys.executable, "-m", "ems.server", "stats", "--socket-dir",
                           server.socket_dir], capture_output=True, text=True, timeout=60,
                          env=server.env)
    assert text.returncode == 0, text.stderr
    assert f"disk {tmp_path / 'disk'}: ok" in text.stdout and "16 object(s)" in text.stdout
    fams = scrape(port)
    tenant = {"tenant": "(anonymous)"}
    assert value(fams, "ems_pool_hits", tier="disk", **tenant) == 4
    assert value(fams, "ems_pool_stored_bytes", tier="disk", **tenant) == 16 * MIB
    assert value(fams, "ems_disk_objects") == 16
    assert value(fams, "ems_disk_tenant_objects", **tenant) == 16
    assert value(fams, "ems_disk_up") == 1


def test_a_save_with_write_out_false_stays_in_shared_memory(make_server, workers, tmp_path):
    """``CcKvOption.write_out=False``: loadable from shared memory, never written to
    disk (no record; after a restart it misses), counted as ``caller``; a save without
    it is written as before. Both save paths: 256 KiB reserve/commit, 16 KiB lease Put."""
    from support.control_support import free_port, scrape, value

    port = free_port()
    server = make_server(capacity="32M", extra_args=_disk_args(
        tmp_path, "--metrics-addr", f"127.0.0.1:{port}"))
    kept = {size: [f"kept-{size}-{i}" for i in range(8)] for size in (256 << 10, 16 << 10)}
    skip = {size: [f"skip-{size}-{i}" for i in range(8)] for size in (256 << 10, 16 << 10)}
    for size in kept:
        assert workers.run(server, "save", keys=skip[size], size=size,
                           write_out=False) == {"success": 8}
        assert workers.run(server, "save", keys=kept[size], size=size) == {"success": 8}
    d = _settled(server, 16)
    assert d["objects"] == 16 and d["skipped_caller"] == 16 and d["not_admitted"] == 0
    for size in skip:  # from shared memory, byte for byte
        assert workers.run(server, "load", keys=skip[size], size=size) == {
            "success": 8, "wrong": 0}
    assert value(scrape(port), "ems_disk_admissions_refused", reason="caller") == 16
    assert value(scrape(port), "ems_disk_objects") == 16
    _checkpointed(server)
    server.stop()
    server.start()  # shared memory is gone: only the disk remains
    d = _recovered(server)
    assert d["records_recovered"] == 16
    for size in kept:
        assert workers.run(server, "load", keys=kept[size], size=size) == {
            "success": 8, "wrong": 0}
        assert workers.run(server, "load", keys=skip[size], size=size) == {
            "success": 0, "wrong": 0}


def test_the_directory_removed_turns_the_tier_off_and_the_daemon_serves(make_server, workers,
                                                                        tmp_path):
    import shutil
    server = make_server(capacity="32M", extra_args=_disk_args(tmp_path))
    keys = [f"gone-{i}" for i in range(8)]
    assert workers.run(server, "save", keys=keys, size=MIB)["success"] == 8
    _settled(server, 8)
    shutil.rmtree(tmp_path / "disk")
    more = [f"after-{i}" for i in range(8)]
    assert workers.run(server, "save", keys=more, size=MIB) == {"success": 8}
    wait_for(lambda: _disk(server)["state"] == "off", 20, "the disk tier off")
    assert workers.run(server, "save", keys=[f"later-{i}" for i in range(8)],
                       size=MIB) == {"success": 8}
    assert workers.run(server, "load", keys=more, size=MIB) == {"success": 8, "wrong": 0}
    assert server.running
    errors = [line for line in server.log().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(tmp_path / "disk") in errors[0], errors


def test_a_load_during_recovery_waits_for_it(make_server, client_env, tmp_path, figures):
    """After a crash with no checkpoint the restart scans every record; a load sent the
    moment the socket accepts waits for that scan (within its deadline) instead of
    missing."""
    server = make_server(capacity="64M", extra_args=_disk_args(tmp_path, checkpoint_s="3600"))
    client_env(server)
    config = EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="itest"))
    size, n = 4096, 8000
    keys = [f"rec-{i}" for i in range(n)]
    Ems.init(config)
    try:
        cc = Ems.get_cc()
        for part in _batches(keys, 2000):
            vals = _values(part, size)  # alive until the save returned
            assert cc.save(CcKvOption(timeout=20000), part,
                           [v.wrappers() for v in vals]).success == len(part)
    finally:
        Ems.finalize()
    _settled(server, n, timeout_s=120)
    server.kill()  # no checkpoint was taken: the restart scans all 8000 records
    server.start()
    Ems.init(config)
    try:
        cc = Ems.get_cc()
        probe = keys[-64:]
        hits, bad = _load_checked(cc, probe, size, timeout_ms=20000)
        assert (hits, bad) == (64, 0)
    finally:
        Ems.finalize()
    d = _disk(server)
    assert not d["scan_skipped"] and d["records_recovered"] == n
    figures.update(records=n, recovery_s=round(d["recovery_s"], 3))
