"""Entries read from the input streams, sized and decoded before any of them is handled."""

from __future__ import annotations

from coordinator.envelope import Message
from coordinator.outcome import Outcome
from protocol import deadletter
from protocol.exceptions import PerseusError
from protocol.models import decode_message

Entry = tuple[str, str, dict[bytes, bytes] | None]  # stream, entry id, fields (None: gone)
Decoded = dict[tuple[str, str], Message | Exception]  # (stream, entry id) -> message or error
Pending = tuple[str, str, dict[bytes, bytes], Message]


def decode_ahead(entries: list[Entry], decoded: Decoded, max_entry_bytes: int) -> None:
    """Decode the entries not decoded yet into ``decoded`` (what failed: its error).

    An entry over ``max_entry_bytes`` is left out: :func:`screen` refuses it undecoded.
    """
    for stream, entry_id, fields in entries:
        if (stream, entry_id) in decoded or fields is None:
            continue
        if deadletter.entry_size(fields) > max_entry_bytes:
            continue
        try:
            decoded[(stream, entry_id)] = decode_message(fields)
        except (PerseusError, ValueError) as exc:
            decoded[(stream, entry_id)] = exc


def screen(
    entries: list[Entry], decoded: Decoded | None, outcome: Outcome, max_entry_bytes: int
) -> list[Pending]:
    """The entries' messages; each entry is to be acknowledged, as ``outcome`` records.

    An entry trimmed away while pending (no fields) is recorded as lost; one over
    ``max_entry_bytes`` is dead-lettered before decoding (a huge msgpack payload costs memory
    to unpack), and so is one that does not decode. ``decoded``: messages (or errors) of
    entries that :func:`decode_ahead` decoded already, so sized already.
    """
    pending: list[Pending] = []
    for stream, entry_id, fields in entries:
        outcome.acks.setdefault(stream, []).append(entry_id)
        if not fields:  # XADD needs a field: none means the entry is gone
            outcome.lost.setdefault(stream, []).append(entry_id)
            continue
        known = decoded.get((stream, entry_id)) if decoded else None
        size = 0 if known is not None else deadletter.entry_size(fields)
        if size > max_entry_bytes:
            reason = (
                f"entry of {size} bytes is over max_entry_bytes="
                f"{max_entry_bytes} (PERSEUS_MAX_ENTRY_BYTES)"
            )
            outcome.dead(stream, entry_id, fields, reason, oversize=True)
            continue
        try:
            if isinstance(known, Exception):
                raise known
            pending.append((stream, entry_id, fields, known or decode_message(fields)))
        except (PerseusError, ValueError) as exc:
            outcome.dead(stream, entry_id, fields, str(exc) or type(exc).__name__)
    return pending
