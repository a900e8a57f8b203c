"""Each input message handled: its checks and store write queued, then its write's answer read."""

from __future__ import annotations

import logging
from typing import Any

from coordinator.completion import CompletionGuess
from coordinator.envelope import Message, check_envelope
from coordinator.job_config import check_job_limits, job_config
from coordinator.outcome import Outcome
from coordinator.records import RecordCache
from coordinator.registration import RankRegistrar, check_still_awaited, job_answer
from coordinator.settings import PerseusSettings
from coordinator.trust import ResultKeys
from protocol import keys
from protocol.exceptions import UnknownJobError
from protocol.job_record import make_job_id
from protocol.models import RegisterJob, RegisterRank, Reply, ReportResult
from protocol.scheduler import resolve_scheduler
from protocol.store import JobRecord
from protocol.store_batch import Source, StoreBatch

# The coordinator's logger: what it says of messages keeps the name it had before this split off.
logger = logging.getLogger("coordinator.service")


class MessageHandler:
    """What the coordinator does with each kind of message, around its batch's one write.

    Args:
        registrar: Answers ranks' registrations.
        result_keys: Checks results' MACs.
        records: The coordinator's cache of job records.
        guess: Its guess of which versions a batch completes.
    """

    def __init__(
        self,
        registrar: RankRegistrar,
        result_keys: ResultKeys,
        records: RecordCache,
        guess: CompletionGuess,
    ) -> None:
        self._registrar = registrar
        self._result_keys = result_keys
        self._records = records
        self._guess = guess

    def dispatch(
        self,
        settings: PerseusSettings,
        batch: StoreBatch,
        message: Message,
        stream: str,
        entry_id: str,
        fields: dict[bytes, bytes],
        jobs: dict[str, JobRecord | None],
        now: float,
    ) -> None:
        """Check ``message`` against ``settings`` (the coordinator's now) and queue its write.

        Raises:
            PerseusError: The entry is to be dead-lettered (its reason the message).
            ValueError: Likewise, for arguments a scheduler refuses.
        """
        check_envelope(stream, fields, message)
        if isinstance(message, RegisterJob | RegisterRank):
            check_still_awaited(message, fields, entry_id, now)
        if isinstance(message, RegisterJob):
            job = message.job
            check_job_limits(settings, job)
            config = job_config(settings, message)
            name = config.scheduler.rpartition(":")[2] or config.scheduler
            job = job.model_copy(update={"job_id": make_job_id(job, name, entry_id)})
            message.job = job
            answer = job_answer(settings, message, job.job_id, stream, entry_id)
            batch.create_job(job, config, entry_id, now, message.request_id, answer)
            # Cached once stored (settle): the job's first rank then reads nothing.
            jobs[job.job_id] = JobRecord(info=job, config=config, fields={})
            return
        record = jobs.get(message.job_id)
        if record is None:
            raise UnknownJobError(f"unknown job id {message.job_id!r}")
        info = record.info
        if isinstance(message, RegisterRank):
            self._registrar.queue(batch, record, message, stream, entry_id, now)
        elif isinstance(message, ReportResult):
            self._result_keys.check(message, fields)
            # One its scheduler cannot use is dead-lettered here: stored, it would fail the job.
            scheduler = resolve_scheduler(record.config.scheduler)
            scheduler.check_job_result(message.result, record.config.scheduler_args)
            # Stored as it arrived (validated above): packing it again costs more than the rest.
            source = Source(stream, keys.COORDINATOR_GROUP, entry_id)  # acked by the script
            batch.add_result(info, message.result, now, data=fields[b"data"], source=source)
        else:
            resolve_scheduler(record.config.scheduler).check_target(
                info.job_id, message.iteration_time
            )
            batch.add_control(message, entry_id, now)

    def settle(
        self,
        message: Message,
        result: Any,
        jobs: dict[str, JobRecord | None],
        outcome: Outcome,
        now: float,
    ) -> None:
        """Decide the reply and the scheduler work of an entry whose write succeeded."""
        if isinstance(message, RegisterJob):
            if isinstance(result, str):  # A retry of a request that created a job already.
                logger.info("request %s: job %s registered before", message.request_id, result)
                message.job = message.job.model_copy(update={"job_id": result})
            elif result:
                logger.info("registered job %s", message.job.job_id)
                if record := jobs.get(message.job.job_id):
                    self._records.add(record)
                return  # The script that created it answered it (see job_answer).
            outcome.reply(message.request_id, Reply(ok=True, job_id=message.job.job_id))
            return
        record = jobs[message.job_id]
        assert record is not None
        info = record.info
        if isinstance(message, RegisterRank):
            logger.info(
                "job %s: rank %d registered (%d/%d)",
                info.job_id,
                message.rank_info.rank,
                result,
                info.world_size,
            )
            self._registrar.stamped(info.job_id, now)
            if result == info.world_size:
                outcome.advance.add(info.job_id)
        elif isinstance(message, ReportResult):
            _added, latest, count = result
            if message.result.schedule_version == latest:
                self._guess.record(info.job_id, latest, count)
                if count >= info.world_size:
                    outcome.advance.add(info.job_id)
                    outcome.completed.add(info.job_id)  # its task recorded by the script
        else:
            outcome.advance.add(info.job_id)
