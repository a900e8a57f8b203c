"""Dead letters: the entry format (written and read here), and replaying them to their stream.

The coordinator moves an entry it cannot process to ``perseus:stream:deadletter`` with the
reason and every original field as ``orig:<name>``. Some of those become valid later: a result
for a version that Redis had lost and a worker published again, or a control message for a job
whose scheduler was fixed. Replaying an entry adds its original fields to its source stream and
deletes the dead letter in one Lua script. If the entry fails again, the coordinator
dead-letters it again with the new reason, so either way nothing is lost (like ``rq requeue``
for failed jobs).

Registrations are never replayed: their client already got the error as its reply and is no
longer waiting, and a replayed ``register_job`` would create a job nobody runs.

An entry of more than :data:`~protocol.constants.MAX_ENTRY_FIELDS` fields (64; a message has
at most five) is refused for that, and its dead letter keeps every field, byte for byte and in
order, packed as one msgpack map (name -> value) in ``orig_packed``, with their number in
``fields``: thousands of ``orig:`` fields would make every ``XRANGE`` of the stream list them.
It is not replayed (the coordinator would refuse it again), nor is an ``orig:`` dead letter of
that many fields (an older coordinator wrote them so): the replay script passes each field
through Lua's ``unpack``, which takes at most about 8,000 values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from protocol import keys
from protocol.constants import MAX_ENTRY_FIELDS, MAX_UNIX_TIME
from protocol.exceptions import ConfigError
from protocol.numbers import is_ascii_digits
from protocol.server_clock import ServerClock

REPLAYABLE_STREAMS = (keys.RESULTS_STREAM, keys.CONTROL_STREAM)

# Re-add and delete only if the dead letter is still there: two replays of one entry (say, by
# two operators at once) add it to its source stream once. No MAXLEN: the coordinator trims
# input streams by acknowledgement (protocol/streams.py).
# KEYS[1] dead-letter stream, KEYS[2] source stream; ARGV[1] dead letter id, ARGV[2..] fields
# (at most MAX_ENTRY_FIELDS of them: Lua's unpack takes at most about 8,000 values).
_REPLAY = """
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return false end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], ARGV[1])
return id
"""

_ORIG = b"orig:"
_PACKED = b"orig_packed"


HEAD_BYTES = 256
"""How much of each field an oversize entry's dead letter keeps."""
HEAD_FIELDS = 16
"""How many fields an oversize entry's dead letter keeps (a million tiny fields add up too)."""


def entry_size(fields: dict[bytes, bytes]) -> int:
    """Bytes of an entry's field names and values."""
    return sum(len(name) + len(value) for name, value in fields.items())


def entry_fields(
    source_stream: str,
    source_id: str,
    fields: dict[bytes, bytes],
    reason: str,
    now: float,
    oversize: bool = False,
) -> dict[Any, Any]:
    """The fields of a dead letter: the reason, where it came from, every original field.

    Every original field is kept byte for byte as ``orig:<name>``, so nothing is lost and
    :func:`replay` can send the entry back unchanged. An ``oversize`` entry keeps only the
    first :data:`HEAD_BYTES` of its first :data:`HEAD_FIELDS` fields, its total size
    (``size``) and field count (``fields``): copying it whole would let one client fill Redis
    with dead letters. It cannot be replayed. An entry of more than
    :data:`~protocol.constants.MAX_ENTRY_FIELDS` fields keeps them all as one msgpack map in
    ``orig_packed``, and their number in ``fields``.
    """
    entry: dict[Any, Any] = {
        "reason": reason,
        "source_stream": source_stream,
        "source_id": source_id,
        "dead_at": f"{now:.3f}",
    }
    if oversize:
        entry["size"] = str(entry_size(fields))
        entry["fields"] = str(len(fields))
        head = list(fields.items())[:HEAD_FIELDS]
        entry.update({_ORIG + name[:HEAD_BYTES]: v[:HEAD_BYTES] for name, v in head})
    elif len(fields) > MAX_ENTRY_FIELDS:
        entry["fields"] = str(len(fields))
        entry[_PACKED] = msgpack.packb(fields, use_bin_type=True)
    else:
        entry.update({_ORIG + name: value for name, value in fields.items()})
    return entry


@dataclass(frozen=True)
class DeadLetter:
    """One dead-lettered entry."""

    entry_id: str
    reason: str
    source_stream: str
    source_id: str
    dead_at: float  # unix time it was dead-lettered; 0: unknown (none, or none a date can show)
    original: dict[bytes, bytes]
    size: int | None = None  # set when the entry was oversize and only its head was kept

    @property
    def kind(self) -> str:
        """The message kind of the original entry (``report_result``, ...), if it had one."""
        return self.original.get(b"kind", b"").decode(errors="replace")

    @property
    def job_id(self) -> str:
        """The job id of the original entry, if it had one."""
        return self.original.get(b"job_id", b"").decode(errors="replace")

    @property
    def too_many_fields(self) -> bool:
        """Whether the entry had more fields than an entry may have (it would be refused again)."""
        return len(self.original) > MAX_ENTRY_FIELDS

    @property
    def replayable(self) -> bool:
        """Whether :func:`replay` accepts it (results and control messages, kept whole)."""
        return (
            self.source_stream in REPLAYABLE_STREAMS
            and self.size is None
            and bool(self.original)
            and not self.too_many_fields
        )

    def summary(self) -> dict[str, Any]:
        """JSON-friendly fields (the original data stays in Redis)."""
        return {
            "id": self.entry_id,
            "dead_at": self.dead_at,
            "source_stream": self.source_stream,
            "source_id": self.source_id,
            "kind": self.kind,
            "job_id": self.job_id,
            "reason": self.reason,
            "replayable": self.replayable,
        }


def _parse(entry_id: bytes | str, fields: dict[bytes, bytes]) -> DeadLetter:
    def text(name: bytes) -> str:
        return fields.get(name, b"").decode(errors="replace")

    try:
        dead_at = float(text(b"dead_at") or 0)
    except ValueError:
        dead_at = 0.0
    if not 0 <= dead_at <= MAX_UNIX_TIME:  # NaN included: a time no one can show (0: unknown)
        dead_at = 0.0
    return DeadLetter(
        entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        reason=text(b"reason"),
        source_stream=text(b"source_stream"),
        source_id=text(b"source_id"),
        dead_at=dead_at,
        original=_unpacked(fields[_PACKED])
        if _PACKED in fields
        else {k[len(_ORIG) :]: v for k, v in fields.items() if k.startswith(_ORIG)},
        size=int(text(b"size")) if is_ascii_digits(text(b"size")) else None,
    )


def _unpacked(packed: bytes) -> dict[bytes, bytes]:
    """The original fields packed in ``orig_packed`` (none if it is no map of bytes)."""
    try:
        original = msgpack.unpackb(packed, raw=True)
    except Exception:  # written by hand: no map (or no msgpack) means no original fields
        return {}
    if not isinstance(original, dict) or not all(
        isinstance(k, bytes) and isinstance(v, bytes) for k, v in original.items()
    ):
        return {}
    return original


def list_dead_letters(conn: redis.Redis, count: int = 100) -> list[DeadLetter]:
    """The oldest ``count`` dead letters."""
    return [_parse(i, f) for i, f in conn.xrange(keys.DEADLETTER_STREAM, count=count)]


def iter_dead_letters(conn: redis.Redis, page: int = 1000) -> Iterator[DeadLetter]:
    """Every dead letter there is now, oldest first, read ``page`` at a time.

    Stops at the newest one there was when it started: entries dead-lettered meanwhile (a
    replayed entry that fails again, say) are not read, so a loop that replays what it reads
    ends.
    """
    newest = conn.xrevrange(keys.DEADLETTER_STREAM, count=1)
    if not newest:
        return
    last = newest[0][0]
    start: bytes | str = "-"
    while True:
        rows = conn.xrange(keys.DEADLETTER_STREAM, min=start, max=last, count=page)
        for entry_id, fields in rows:
            yield _parse(entry_id, fields)
        if len(rows) < page:
            return
        start = b"(" + rows[-1][0]


def get_dead_letter(conn: redis.Redis, entry_id: str) -> DeadLetter:
    """One dead letter by id.

    Raises:
        ConfigError: There is no such entry (wrong id, already replayed, or trimmed).
    """
    try:
        rows = conn.xrange(keys.DEADLETTER_STREAM, min=entry_id, max=entry_id)
    except redis.ResponseError as exc:
        raise ConfigError(f"{entry_id!r} is not a stream entry id: {exc}") from None
    if not rows:
        raise ConfigError(
            f"no dead letter {entry_id} in {keys.DEADLETTER_STREAM} "
            "(already replayed or purged, or cut at the stream cap, PERSEUS_STREAM_HARD_CAP?)"
        )
    return _parse(*rows[0])


def replay(conn: redis.Redis, letter: DeadLetter) -> str | None:
    """Send ``letter`` back to its source stream; return the new entry id.

    Returns None if someone else replayed or deleted it meanwhile.

    Raises:
        ConfigError: It is a registration, or came from no input stream.
    """
    if letter.size is not None:
        raise ConfigError(
            f"dead letter {letter.entry_id} was an entry of {letter.size} bytes, over "
            "max_entry_bytes: only its head was kept, so it cannot be replayed"
        )
    if letter.too_many_fields:
        raise ConfigError(
            f"dead letter {letter.entry_id} was an entry of {len(letter.original)} fields; at "
            f"most {MAX_ENTRY_FIELDS}, so the coordinator would refuse it again (its fields are "
            "all kept; `perseus deadletter purge` deletes it)"
        )
    if not letter.original:  # one added by hand: --all skips it (not replayable)
        raise ConfigError(f"dead letter {letter.entry_id} has no original fields to replay")
    if not letter.replayable:
        raise ConfigError(
            f"dead letter {letter.entry_id} came from {letter.source_stream or 'nowhere'}; only "
            f"entries of {', '.join(REPLAYABLE_STREAMS)} can be replayed (a registration's "
            "client got the error and is no longer waiting)"
        )
    fields = [part for item in letter.original.items() for part in item]
    script = conn.register_script(_REPLAY)
    new_id = script(
        keys=[keys.DEADLETTER_STREAM, letter.source_stream],
        args=[letter.entry_id, *fields],
    )
    if new_id is None:
        return None
    return new_id.decode() if isinstance(new_id, bytes) else str(new_id)


def purge(
    conn: redis.Redis,
    entry_ids: list[str] | None = None,
    older_than_s: float | None = None,
    now: float | None = None,
) -> int:
    """Delete dead letters: the given ids, or all older than ``older_than_s``; return how many.

    Entry ids start with the time they were dead-lettered (ms), so "older than" is one
    ``XTRIM MINID``. With neither argument every dead letter goes (the stream is deleted).

    Raises:
        ConfigError: Both selections given, or a negative or not finite age.
    """
    if entry_ids is not None and older_than_s is not None:
        raise ConfigError("purge either entry ids or entries older than a time, not both")
    if entry_ids is not None:
        return int(conn.xdel(keys.DEADLETTER_STREAM, *entry_ids)) if entry_ids else 0
    if older_than_s is not None:
        if not 0 <= older_than_s < math.inf:
            raise ConfigError(f"older_than_s must be finite and >= 0, got {older_than_s}")
        # Entry ids are the server's time: compare with its clock, not this machine's.
        now = ServerClock.of(conn).now() if now is None else now
        cutoff_ms = int((now - older_than_s) * 1000)
        if cutoff_ms <= 0:  # older than the epoch: none (and Redis refuses a negative MINID)
            return 0
        return int(conn.xtrim(keys.DEADLETTER_STREAM, minid=f"{cutoff_ms}-0", approximate=False))
    count = int(conn.xlen(keys.DEADLETTER_STREAM))
    conn.delete(keys.DEADLETTER_STREAM)
    return count
