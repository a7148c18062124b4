"""Sealing secrets for the wire and at rest, and reading secret files: shared by the
control plane (``ems.control``, which seals access keys) and the daemon's registry sync
(``ems.server.control_sync``, which opens them), so the daemon never imports the
control plane. The threat model is in :mod:`ems.control.keys`."""

from __future__ import annotations

import base64
import os
import stat
from typing import Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ems.errors import EmsErrorCode, EmsException, invalid

__all__ = ["Sealer", "read_secret_file", "transport_sealer"]

_NONCE = 12


class Sealer:
    """AES-256-GCM with a random 96-bit nonce per seal; the associated data binds a
    ciphertext to the row (``access_id``, ``key_id``) it belongs to."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise invalid(f"a sealing key must be 32 bytes, got {len(key)}")
        self._aead = AESGCM(key)

    def seal(self, secret: str, access_id: str, kid: str) -> bytes:
        nonce = os.urandom(_NONCE)
        return nonce + self._aead.encrypt(nonce, secret.encode(), _aad(access_id, kid))

    def open(self, sealed: bytes, access_id: str, kid: str) -> str:
        try:
            return self._aead.decrypt(sealed[:_NONCE], sealed[_NONCE:],
                                      _aad(access_id, kid)).decode()
        except (InvalidTag, ValueError) as exc:
            raise EmsException(EmsErrorCode.EMS_AUTH_FAILED,
                               f"key {kid} of {access_id!r} does not open with this "
                               f"sealing key (another master key or daemon token?)") from exc

    def seal_text(self, secret: str, access_id: str, kid: str) -> str:
        return base64.b64encode(self.seal(secret, access_id, kid)).decode()

    def open_text(self, text: str, access_id: str, kid: str) -> str:
        try:
            raw = base64.b64decode(text, validate=True)
        except ValueError as exc:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                               f"key {kid} of {access_id!r} is not base64") from exc
        return self.open(raw, access_id, kid)


def _aad(access_id: str, kid: str) -> bytes:
    return b"ems-key-v1\x00" + access_id.encode() + b"\x00" + kid.encode()


def transport_sealer(daemon_token: str) -> Sealer:
    """The sealer of registry responses: HKDF-SHA256 of the daemon token."""
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"ems-control",
               info=b"ems-registry-v1").derive(daemon_token.encode())
    return Sealer(key)


def read_secret_file(path: str, what: str, *, create: Optional[str] = None) -> str:
    """The stripped text of a secret file that group and others cannot read.

    ``create``: when the file does not exist, write this value there (mode 0600) and
    return it (the service makes its own token and key files on first start).
    """
    if create is not None and not os.path.lexists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(create + "\n")
        return create
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise invalid(f"{what} {path} is not a regular file")
        if st.st_mode & 0o077:
            raise invalid(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; it holds "
                          f"a secret and must be 0600 (chmod 600 {path})")
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError as exc:
        raise invalid(f"{what} {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise invalid(f"{what} {path} is not ASCII text") from exc
    if len(text) < 16:
        raise invalid(f"{what} {path} holds {len(text)} characters; at least 16 are needed")
    return text
