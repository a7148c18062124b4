"""Access keys: generated, sealed at rest, sealed again for the daemons.

What the HMAC challenge forces. A client proves it holds its ``access_key`` with
``auth_mac(access_key, nonce, access_id)`` (HMAC-SHA256 keyed with the access key
itself, ``ems.protocol.messages``). To check it, a daemon must hold the access key, or
something that computes the same MAC: password-equivalent either way. So no hash at
rest can protect the keys the way a password hash would; what the service does
instead::

    generate_key() --> seal(master key) --> SQLite row  (at rest: AES-256-GCM)
                                              |
        GET /v1/registry (daemon token) <-- unseal(master) + seal(transport key)
                                              |
        daemon: open(transport key) --> memory only --> HMAC check of each Auth

* At rest every key is sealed with AES-256-GCM under a 32-byte master key that lives
  in its own file (mode 0600, ``--master-key-file``), never in the database; the
  associated data binds each ciphertext to its ``access_id`` and ``key_id``, so a
  sealed key copied into another row does not open. A stolen copy of the database
  (a backup, a replica, a disk image without the key file) hands out no usable key.
* On the wire to the daemons each key is sealed again, under a key derived from the
  daemon token (HKDF-SHA256), so a registry response read off an unencrypted network
  holds no key either; only holders of the daemon token can open it.
* NOT protected: whoever has the master key file and the database (root on the
  control host, or both in one backup) has every key; whoever has the daemon token
  and can call the registry endpoint has every key; a daemon's memory holds the keys
  of its tenants. Revoking and rotating keys is the remedy after such a loss.
"""

from __future__ import annotations

import base64
import os
import secrets
import stat
from typing import Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ems.errors import EmsErrorCode, EmsException, invalid

__all__ = ["KEY_ALPHABET", "Sealer", "generate_key", "key_id", "read_secret_file",
           "transport_sealer"]

#: The documented alphabet of access keys (``EmsConfig.access_key``).
KEY_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz+/="
KEY_MIN, KEY_MAX, KEY_DEFAULT = 32, 256, 64
_NONCE = 12


def generate_key(length: int = KEY_DEFAULT) -> str:
    """A fresh access key of ``length`` characters (log2(65) = 6.02 bits each: 64
    characters carry 385 bits)."""
    if isinstance(length, bool) or not isinstance(length, int) or not (
            KEY_MIN <= length <= KEY_MAX):
        raise invalid(f"length must be an int in {KEY_MIN}..{KEY_MAX}, got {length!r}")
    return "".join(secrets.choice(KEY_ALPHABET) for _ in range(length))


def key_id() -> str:
    """A public name for one key (listed, logged; tells nothing about the secret)."""
    return "k-" + secrets.token_hex(6)


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
