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

import base64
import hashlib
import hmac
import os
from typing import NamedTuple

TOKEN_BYTES = 32
"""Random bytes per token (256 bits)."""


def new_token() -> str:
    """A fresh random token (URL-safe text)."""
    return _as_text(os.urandom(TOKEN_BYTES))


def _as_text(secret: bytes) -> str:
    # What secrets.token_urlsafe does with its bytes: URL-safe base64 without padding.
    return base64.urlsafe_b64encode(secret).rstrip(b"=").decode()


class Credentials(NamedTuple):
    """A fresh token with the two digests Redis keeps of it (its repr hides the token)."""

    token: str
    result_key: str
    beat_digest: str

    def __repr__(self) -> str:
        return f"Credentials(token=<hidden>, result_key={self.result_key[:8]}...)"


def alive_proof(key: str) -> str:
    """What a rank's heartbeats and its finish carry besides its rank number.

    Derived from the rank's result key (``sha256(token)``), which only the rank itself and
    the services can compute or read: another rank can neither name the entry to lower a
    rank's last heartbeat nor fake its finish, and the sweep, which deletes jobs on those
    marks, checks each one against the stored key (:meth:`JobStore.verified_activity`).

    Args:
        key: The rank's :func:`result_key`.
    """
    return hashlib.sha256(f"{key}:alive".encode()).hexdigest()[:32]


def proof_marks(stored_keys: dict[bytes, bytes]) -> dict[int, str]:
    """Each rank's ``<rank>:<alive proof>``: the one mark of it that counts in its job's sets.

    The sweep asks for these members (ZMSCORE, SMISMEMBER): whatever else another rank wrote
    into those sets costs it nothing.

    Args:
        stored_keys: The job's tokens hash as read (rank -> result key, then request id).
    """
    return {
        int(rank): f"{int(rank)}:{alive_proof(value[:64].decode())}"
        for rank, value in stored_keys.items()
    }


def credentials(token: str) -> Credentials:
    """``token`` with its digests.

    Args:
        token: A rank's token.

    Returns:
        The token, its SHA-256 (:func:`result_key`) and its SHA-1 (:func:`beat_digest`).
    """
    return Credentials(token, result_key(token), beat_digest(token))


# Bumped in every child a fork makes: a supply made before must not hand out the tokens that
# its parent holds too (a process id can be reused, a fork count cannot).
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


class TokenSupply:
    """Fresh tokens with their digests, made in batches off a registration's path.

    A coordinator answers registrations one after another; making a token and hashing it
    costs a system call and two digests each, while the rank waits. :meth:`top_up` (the
    coordinator calls it after each read, while the ranks it answered send their next
    requests) makes them ahead; :meth:`take` hands one out, once. Each token is
    :data:`TOKEN_BYTES` from ``os.urandom``, like :func:`new_token`'s.

    Args:
        batch: Tokens kept ready; a refill tops up to it once half are used.

    Raises:
        ValueError: ``batch`` is below 1.
    """

    def __init__(self, batch: int = 64) -> None:
        if batch < 1:
            raise ValueError(f"batch={batch}: a token supply keeps at least one token")
        self.batch = batch
        self._ready: list[Credentials] = []
        self._forks = _forks

    def __len__(self) -> int:
        return len(self._ready)

    def _forget_if_forked(self) -> None:
        if self._forks != _forks:
            self._ready, self._forks = [], _forks

    def top_up(self) -> None:
        """Refill when no more than half a batch is ready (one ``os.urandom`` call)."""
        self._forget_if_forked()
        missing = self.batch - len(self._ready)
        if missing < max(1, self.batch // 2):
            return
        raw = os.urandom(TOKEN_BYTES * missing)
        for i in range(0, len(raw), TOKEN_BYTES):
            self._ready.append(credentials(_as_text(raw[i : i + TOKEN_BYTES])))

    def take(self) -> Credentials:
        """A token nobody has had, with its digests."""
        self._forget_if_forked()
        if not self._ready:
            self.top_up()
        return self._ready.pop()


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
