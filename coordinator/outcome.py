"""What a batch of stream entries sends back: replies, dead letters, scheduler work and acks."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from protocol import deadletter, keys
from protocol.models import Reply

logger = logging.getLogger(__name__)


def log_lost(stream: str, entry_ids: list[str]) -> None:
    """One warning per entry removed from ``stream`` while pending (already counted)."""
    for entry_id in entry_ids:
        logger.warning(
            "LOST entry %s %s: removed from the stream before it was processed (trimmed while "
            "pending); counted in %s",
            stream,
            entry_id,
            keys.STREAM_LOSSES,
        )


def _request_reply_key(fields: dict[bytes, bytes]) -> str | None:
    """Reply key of a registration request, found even when the rest of it is invalid.

    So that a client whose request is rejected gets the reason instead of a time-out.
    """
    try:
        raw = msgpack.unpackb(fields[b"data"], raw=False, strict_map_key=False)
        request_id = raw["request_id"]
    except Exception:
        return None
    if isinstance(request_id, str) and 0 < len(request_id) <= 128:
        return keys.reply_key(request_id)
    return None


@dataclass
class Outcome:
    """What a batch of entries sends back: replies, dead letters, scheduler work and acks.

    ``now`` stamps its dead letters (``dead_at``): the coordinator gives the server's clock,
    as for every other stamp.
    """

    now: float = field(default_factory=time.time)
    replies: dict[str, Reply] = field(default_factory=dict)  # reply key -> reply
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    advance: set[str] = field(default_factory=set)  # job ids
    enqueued: dict[str, str] = field(default_factory=dict)  # job id -> rq job enqueued already
    # Jobs whose latest version results of this batch completed: the script that stored them
    # recorded the task enqueued with them (see StoreBatch.note_task).
    completed: set[str] = field(default_factory=set)
    acks: dict[str, list[str]] = field(default_factory=dict)  # stream -> entry ids
    lost: dict[str, list[str]] = field(default_factory=dict)  # stream -> ids gone unread
    self_acked: int = 0  # entries a store script acknowledged

    def reply(self, request_id: str, reply: Reply) -> None:
        """Send ``reply`` to the client of ``request_id``."""
        self.replies[keys.reply_key(request_id)] = reply

    def answered(self, stream: str, entry_id: str) -> None:
        """The store's script already replied to and acknowledged this entry."""
        self.acks[stream].remove(entry_id)
        self.self_acked += 1

    def dead(
        self,
        stream: str,
        entry_id: str,
        fields: dict[bytes, bytes],
        reason: str,
        oversize: bool = False,
        reply: bool = True,
    ) -> None:
        """Dead-letter an entry; a registration's client gets the reason as its reply.

        ``reply=False``: a request answered before (its client must get that first reply).
        """
        self.dead_letters.append(
            deadletter.entry_fields(stream, entry_id, fields, reason, self.now, oversize)
        )
        self.reasons.append(f"{stream} {entry_id}: {reason}")
        # Only a registration's client waits for a reply; a request id in another stream's
        # entry must not reach whoever waits on that key.
        registration = stream == keys.REGISTRATIONS_STREAM
        reply_to = _request_reply_key(fields) if reply and registration else None
        if reply_to is not None:
            self.replies[reply_to] = Reply(ok=False, error=reason)
