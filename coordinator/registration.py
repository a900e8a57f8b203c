"""Registrations, answered in the round trip that stores them; their senders wait meanwhile."""

from __future__ import annotations

import math

from coordinator.job_config import check_rank_limits
from coordinator.settings import PerseusSettings
from protocol import keys
from protocol.codec import pack, pack_rank_reply
from protocol.exceptions import ProtocolError
from protocol.job_record import JobRecord
from protocol.models import RegisterJob, RegisterRank, Reply
from protocol.store_batch import Answer, StoreBatch
from protocol.tokens import TokenSupply

_STAMPS_KEPT = 10_000  # jobs whose last activity stamp a coordinator remembers


def check_still_awaited(
    message: RegisterJob | RegisterRank, fields: dict[bytes, bytes], entry_id: str, now: float
) -> None:
    """Refuse a registration its sender no longer waits for (it timed out and gave up).

    Read later than its sender's ``wait_s`` field (no coordinator ran, or they lagged), it
    would create a job nobody trains, or a rank that never reports: dead-lettered instead,
    kept with the reason for ``perseus deadletter``. A request without the field (a client
    that predates it) has no deadline.

    Args:
        message: The registration.
        fields: Its stream entry's fields.
        entry_id: Its stream entry id; its first part is the Redis server's time of XADD, ms.
        now: The Redis server's time now, seconds (the same clock).

    Raises:
        ProtocolError: ``wait_s`` is not a positive number, or the request is older.
    """
    raw = fields.get(b"wait_s")
    if raw is None:
        return
    try:
        wait_s = float(raw)
    except ValueError:
        wait_s = 0.0  # refused below, like any number that is not positive and finite
    if not (math.isfinite(wait_s) and wait_s > 0):
        raise ProtocolError(f"wait_s must be a positive number of seconds, got {raw!r}")
    age = now - int(entry_id.partition("-")[0]) / 1000
    if age > wait_s:
        raise ProtocolError(
            f"{message.kind} request {message.request_id} is {age:.3g} s old, but its sender "
            f"waited for the reply for wait_s={wait_s:g} s only: not read in time, and nobody "
            "would use it"
        )


def job_answer(
    settings: PerseusSettings, message: RegisterJob, job_id: str, stream: str, entry_id: str
) -> Answer:
    """How the script that creates a job answers its registration and acknowledges its entry.

    Used only if it creates the job: a request seen before gets the job it made, from
    :class:`~coordinator.outcome.Outcome`, once the script said which.

    Args:
        settings: The coordinator's settings (reply TTL).
        message: The job's registration.
        job_id: The id the coordinator gave the job.
        stream: The stream the registration was read from.
        entry_id: Its entry there.
    """
    return Answer(
        reply_key=keys.reply_key(message.request_id),
        reply=pack(Reply(ok=True, job_id=job_id)),
        ttl=settings.reply_ttl,
        stream=stream,
        group=keys.COORDINATOR_GROUP,
        entry_id=entry_id,
    )


class RankRegistrar:
    """Queues a rank's registration with its reply and the acknowledgement of its entry.

    What a registration needs without its request is made ahead, after each read while the
    ranks answered send their next requests: tokens and their digests (:class:`TokenSupply`).

    Args:
        settings: The coordinator's settings (limits, reply TTL, idle time).
    """

    def __init__(self, settings: PerseusSettings) -> None:
        self.settings = settings
        self.tokens = TokenSupply()
        self._stamped: dict[str, float] = {}  # job id -> when a registration stamped it

    def queue(
        self,
        batch: StoreBatch,
        record: JobRecord,
        message: RegisterRank,
        stream: str,
        entry_id: str,
        now: float,
    ) -> None:
        """Queue the registration on ``batch``: stored, answered and acknowledged by one script.

        The reply carries the rank's token; Redis keeps only digests of it.

        Args:
            batch: Where the script call goes.
            record: The rank's job.
            message: The registration.
            stream: The stream it was read from.
            entry_id: Its entry there (the script acknowledges it).
            now: Server time of the activity.

        Raises:
            ProtocolError: The rank is over the coordinator's limits.
        """
        scheduler = check_rank_limits(self.settings, record.config, message.rank_info)
        info = record.info
        fresh = self.tokens.take()
        answer = Answer(
            reply_key=keys.reply_key(message.request_id),
            reply=pack_rank_reply(info.job_id, scheduler.needs_instruction_energy, fresh.token),
            ttl=self.settings.reply_ttl,
            stream=stream,
            group=keys.COORDINATOR_GROUP,
            entry_id=entry_id,
        )
        stamp = self.stamp_due(info.job_id, now)
        batch.add_rank(info, message.rank_info, now, fresh, message.request_id, answer, stamp)

    def stamp_due(self, job_id: str, now: float) -> bool:
        """Whether a registration now should refresh the job's stamp in the jobs index.

        A job's ranks register in a burst: stamping once a second keeps the index as useful
        and spares a write per rank. The interval is shorter where a limit that reads the
        stamp is short: a tenth of ``max_job_idle_time`` or of ``start_retention``.

        Args:
            job_id: The job.
            now: Server time of the registration.

        Returns:
            True unless a registration of the job stamped it less than an interval ago
            (:meth:`stamped` records that).
        """
        settings = self.settings
        interval = min(1.0, settings.max_job_idle_time / 10, settings.start_retention / 10)
        return now - self._stamped.get(job_id, float("-inf")) >= interval

    def stamped(self, job_id: str, now: float) -> None:
        """Record that a registration stored now stamped the job, if :meth:`stamp_due` said so.

        Called once the script has stored it: a registration refused (or not sent) stamped
        nothing, so the next one still must.

        Args:
            job_id: The job.
            now: The ``now`` the registration was queued with.
        """
        if not self.stamp_due(job_id, now):
            return  # Queued without a stamp (or another one of the batch recorded it).
        if len(self._stamped) >= _STAMPS_KEPT:
            self._stamped.clear()  # bounded; forgetting a stamp only costs a write
        self._stamped[job_id] = now

    def prepare(self) -> None:
        """Make tokens ahead (call while no rank waits on this coordinator)."""
        self.tokens.top_up()
