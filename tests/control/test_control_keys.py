"""Access keys: generation, sealing at rest and for transport, secret files."""

from __future__ import annotations

import os
import re

import pytest

from ems.config import EmsConfig, validate_ems_config
from ems.control.keys import (
    KEY_ALPHABET,
    Sealer,
    generate_key,
    read_secret_file,
    transport_sealer,
)
from ems.errors import EmsErrorCode, EmsException


@pytest.mark.parametrize("length", [32, 64, 256])
def test_generated_keys_follow_the_documented_alphabet_and_the_sdk_accepts_them(length):
    keys = {generate_key(length) for _ in range(20)}
    assert len(keys) == 20
    for key in keys:
        assert len(key) == length and re.fullmatch(r"[0-9A-Za-z+/=]+", key)
        validate_ems_config(EmsConfig(access_id="team-a", access_key=key))
    assert set(KEY_ALPHABET) == set("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                    "abcdefghijklmnopqrstuvwxyz+/=")


@pytest.mark.parametrize("length", [31, 257, 0, True, "64"])
def test_key_length_outside_32_256_is_refused(length):
    with pytest.raises(EmsException) as info:
        generate_key(length)
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "length" in info.value.message()


def test_sealed_keys_open_only_with_their_key_and_in_their_row():
    sealer = Sealer(os.urandom(32))
    secret = generate_key()
    blob = sealer.seal(secret, "team-a", "k-1")
    assert secret.encode() not in blob and len(blob) == 12 + len(secret) + 16
    assert sealer.open(blob, "team-a", "k-1") == secret
    assert sealer.seal(secret, "team-a", "k-1") != blob  # a fresh nonce each time
    for access_id, kid in (("team-b", "k-1"), ("team-a", "k-2")):  # moved to another row
        with pytest.raises(EmsException):
            sealer.open(blob, access_id, kid)
    with pytest.raises(EmsException) as info:
        Sealer(os.urandom(32)).open(blob, "team-a", "k-1")  # another master key
    assert info.value.status_code() is EmsErrorCode.EMS_AUTH_FAILED
    tampered = bytearray(blob)
    tampered[-1] ^= 1
    with pytest.raises(EmsException):
        sealer.open(bytes(tampered), "team-a", "k-1")


def test_transport_sealing_is_derived_from_the_daemon_token():
    a, b = transport_sealer("daemon-token-0123456789"), transport_sealer("another-token-xyz")
    text = a.seal_text("S" * 40, "t", "k")
    assert transport_sealer("daemon-token-0123456789").open_text(text, "t", "k") == "S" * 40
    with pytest.raises(EmsException):
        b.open_text(text, "t", "k")
    with pytest.raises(EmsException) as info:
        a.open_text("not base64!", "t", "k")
    assert info.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR


def test_secret_files_are_created_0600_and_refused_when_readable_by_others(tmp_path):
    path = str(tmp_path / "admin.token")
    assert read_secret_file(path, "admin token file", create="x" * 32) == "x" * 32
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_secret_file(path, "admin token file", create="other") == "x" * 32
    os.chmod(path, 0o644)
    with pytest.raises(EmsException) as info:
        read_secret_file(path, "admin token file")
    assert "0644" in info.value.message() and "chmod 600" in info.value.message()
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(EmsException) as info:
        read_secret_file(str(short), "daemon token file")
    assert "at least 16" in info.value.message()
    with pytest.raises(EmsException) as info:
        read_secret_file(str(tmp_path / "missing"), "daemon token file")
    assert "daemon token file" in info.value.message()
