"""Per-rank secrets: what ties a rank's results and heartbeats to the registration that made it.

The coordinator gives each rank a random token in its registration reply; Redis keeps only
two digests of it, never the token:

* ``sha1(token)`` (:func:`beat_digest`) in ``perseus:job:<id>:beatcheck``, which ranks may
  read: the heartbeat script (run as the rank's ACL user) hashes the token a heartbeat
  carries with Redis's ``redis.sha1hex`` and compares. SHA-1's known weakness is collisions;
  finding a 256-bit random token from its digest (a preimage) stays out of reach.
* ``sha256(token)`` (:func:`result_key`) in ``perseus:job:<id>:tokens``, which only the
  services may read: the key of an HMAC-SHA256 that each result entry carries next to its
  data (field ``mac``). A result is checked against it before it may take the rank's slot.

So the token itself never crosses a stream (a rank that can read the results stream sees
MACs, which are of no use for other data), never reaches a dead letter, and never a log.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_BYTES = 32
"""Random bytes per token (256 bits)."""


def new_token() -> str:
    """A fresh random token (URL-safe text)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def beat_digest(token: str) -> str:
    """Hex SHA-1 of the token, as Redis's Lua ``redis.sha1hex`` computes it (heartbeats)."""
    return hashlib.sha1(token.encode()).hexdigest()


def result_key(token: str) -> str:
    """Hex SHA-256 of the token: the HMAC key of the rank's results (kept by the services)."""
    return hashlib.sha256(token.encode()).hexdigest()


def sign(token: str, data: bytes) -> bytes:
    """The ``mac`` field of a result entry whose ``data`` field is ``data``."""
    return hmac.new(bytes.fromhex(result_key(token)), data, hashlib.sha256).hexdigest().encode()


def verify(key_hex: str, data: bytes, mac: bytes | None) -> bool:
    """Whether ``mac`` is the MAC of ``data`` under the stored key (constant time)."""
    if mac is None or key_hex == "":
        return False
    expected = hmac.new(bytes.fromhex(key_hex), data, hashlib.sha256).hexdigest().encode()
    return hmac.compare_digest(expected, mac)
