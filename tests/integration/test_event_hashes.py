"""A V1 save's ``event_hashes`` (the engine's block hashes, for the daemon's KV events)
travel in the ``hashes`` field of Put and Reserve to a real daemon."""

from __future__ import annotations

import pytest

from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.client import remote

torch = pytest.importorskip("torch")

BS = 4


@pytest.fixture
def v1cc(server, client_env):
    client_env(server)
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="ev")))
    cc = Ems.get_cc()
    cc.register_kvcache([[torch.randn(64, BS, 2, 512)]])  # 16 KiB a block
    yield cc
    Ems.finalize()


def _chunks(blocks):
    return [[(b * BS, BS) for b in blocks]]


def test_small_and_large_saves_carry_event_hashes(v1cc, monkeypatch):
    sent = []
    real = remote._put_wire

    def spy(**kw):
        sent.append(kw["hashes"])
        return real(**kw)
    monkeypatch.setattr(remote, "_put_wire", spy)
    opt = CcKvOption(timeout=5000)
    r = v1cc.save(hashes=[1, 2], chunk_descs=_chunks([0, 1]), option=opt,
                  event_hashes=[11, (1 << 64) - 1])
    assert r.success == 2
    assert sent == [[11, (1 << 64) - 1]]  # a small save: one Put through the lease
    n = 60  # 960 KiB: more than a quarter of the 1 MiB lease: Reserve/Commit
    r = v1cc.save(hashes=list(range(100, 100 + n)), chunk_descs=_chunks(range(n)),
                  option=opt, event_hashes=list(range(n)))
    assert r.success == n and len(sent) == 1  # (no Put)
    r = v1cc.save(hashes=[3], chunk_descs=_chunks([2]), option=opt)  # none: still fine
    assert r.success == 1 and v1cc.exists([1, 2, 3, 100], opt).success == 4


def test_event_hashes_are_checked(v1cc):
    opt = CcKvOption(timeout=5000)
    for bad in ([1], [-1, 2], [1 << 64, 2], "12"):
        with pytest.raises(EmsException) as info:
            v1cc.save(hashes=[1, 2], chunk_descs=_chunks([0, 1]), option=opt,
                      event_hashes=bad)
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(EmsException, match="event_hashes"):
        v1cc.load(hashes=[1], chunk_descs=_chunks([0]), option=opt, event_hashes=[1])
