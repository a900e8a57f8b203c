"""Which messages each input stream carries, and the readable fields beside their data."""

from __future__ import annotations

from typing import Union

from protocol import keys
from protocol.exceptions import ProtocolError
from protocol.models import RegisterJob, RegisterRank, ReportResult, SetTarget

Message = Union[RegisterJob, RegisterRank, ReportResult, SetTarget]  # noqa: UP007

# The message kinds each input stream carries: a registration sent to the results stream would
# dodge the rules of its own stream (registrations are answered once and never replayed).
_KINDS = {
    keys.REGISTRATIONS_STREAM: ("register_job", "register_rank"),
    keys.RESULTS_STREAM: ("report_result",),
    keys.CONTROL_STREAM: ("set_target",),
}


def check_envelope(stream: str, fields: dict[bytes, bytes], message: Message) -> None:
    """Raise ProtocolError if ``message`` does not belong on ``stream``.

    Also if the readable ``kind`` or ``job_id`` field beside its data (what ``redis-cli``, dead
    letters and replays show) says otherwise than the data.
    """
    expected = _KINDS.get(stream, ())
    if message.kind not in expected:
        raise ProtocolError(
            f"a {message.kind} message does not belong on {stream} (it carries "
            f"{' and '.join(expected) or 'nothing'})"
        )
    for name, actual in ((b"kind", message.kind), (b"job_id", getattr(message, "job_id", ""))):
        said = fields.get(name)
        if said is not None and actual and said.decode("utf-8", "replace") != actual:
            raise ProtocolError(
                f"field {name.decode()!r} says {said.decode('utf-8', 'replace')!r} but the "
                f"data's {name.decode()} is {actual!r}"
            )
