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

import secrets

from ems.errors import invalid
from ems.sealing import Sealer, read_secret_file, transport_sealer

__all__ = ["KEY_ALPHABET", "Sealer", "generate_key", "key_id", "read_secret_file",
           "transport_sealer"]

#: The documented alphabet of access keys (``EmsConfig.access_key``).
KEY_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz+/="
KEY_MIN, KEY_MAX, KEY_DEFAULT = 32, 256, 64


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
