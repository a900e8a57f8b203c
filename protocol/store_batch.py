"""Store writes queued on one pipeline, so that a batch of stream entries costs one round trip."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from protocol import keys
from protocol.codec import pack, pack_plain
from protocol.exceptions import DuplicateEntryError, ProtocolError, UnknownJobError
from protocol.job_record import unknown_job
from protocol.models import (
    JobConfig,
    JobInfo,
    ProfilingResult,
    RankInfo,
    SetTarget,
)
from protocol.store_scripts import Scripts
from protocol.tokens import Credentials

REQUEST_TTL_S = 24 * 3600
"""How long a ``register_job`` request id keeps naming the job it created (client retries)."""


class Answer(NamedTuple):
    """How a script answers and acknowledges the stream entry whose write succeeded."""

    reply_key: str
    reply: bytes
    ttl: int
    stream: str
    group: str
    entry_id: str


class Source(NamedTuple):
    """The stream entry a write came in, which its script acknowledges once it succeeded."""

    stream: str
    group: str
    entry_id: str


@lru_cache(maxsize=1024)
def _rank_keys(job_id: str) -> tuple[str, ...]:
    # Every rank of a job registers: its key names are built once.
    return (
        keys.job_info(job_id),
        keys.job_ranks(job_id),
        keys.JOBS_INDEX,
        keys.DUE_JOBS,
        keys.job_tokens(job_id),
        keys.job_beatcheck(job_id),
    )


class StoreBatch:
    """Store writes queued on one pipeline: many entries, one round trip.

    Each method queues one atomic write; :meth:`execute` returns, in order, each write's
    outcome (what the same ``JobStore`` method returns) or the PerseusError it raised.
    """

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self._commands: list[tuple[Script, list[str], list[Any]]] = []
        # Per write: the index of the command carrying it (None: refused before sending) and
        # how to turn that command's reply into the write's outcome.
        self._ops: list[tuple[int | None, Callable[[Any], Any]]] = []
        # (job, version, source stream and group) -> the command storing those results
        self._result_groups: dict[tuple[str, int, tuple[str, str] | None], int] = {}
        self._tasks: dict[str, list[int]] = {}  # job -> its results' commands
        self.then_ok = False  # whether execute's ``then`` commands all succeeded

    def _add(
        self, command: tuple[Script, list[str], list[Any]], finish: Callable[[Any], Any]
    ) -> None:
        self._commands.append(command)
        self._ops.append((len(self._commands) - 1, finish))

    def __len__(self) -> int:
        return len(self._ops)

    def note_task(self, job_id: str, task_id: str) -> None:
        """Have the results queued for ``job_id`` record ``task_id`` as the rq task advancing it.

        Recorded by the script that stores them only if they complete the job's latest
        version ('rq_job' and 'enqueued_at' of the job info, what the sweep checks): the
        caller enqueues that task in the same transaction, on a guess.
        """
        for index in self._tasks.get(job_id, []):
            self._commands[index][2][5] = task_id

    def create_job(
        self,
        job: JobInfo,
        config: JobConfig,
        entry_id: str,
        now: float,
        request_id: str | None = None,
        answer: Answer | None = None,
    ) -> None:
        """Queue :meth:`JobStore.create_job`.

        With ``request_id``, a request seen before whose job still exists creates nothing: its
        outcome is that job's id (a str) instead of True/False.

        Args:
            job: The job, its ``job_id`` set.
            config: Its scheduler and arguments.
            entry_id: Its registration's stream entry (the job's owner).
            now: Unix time of the registration.
            request_id: The registration request.
            answer: A job created now is also answered and its entry acknowledged by the
                same script (needs ``request_id``); a job that existed is not.
        """
        if answer is not None and not request_id:
            raise ValueError("answer needs request_id: the script reads its keys after it")
        fields: dict[str, str] = {
            "job_id": job.job_id,
            "pp_degree": str(job.pp_degree),
            "dp_degree": str(job.dp_degree),
            "tp_degree": str(job.tp_degree),
            "world_size": str(job.world_size),
            "job_metadata": job.job_metadata or "",
            "scheduler": config.scheduler,
            "scheduler_args": json.dumps(config.scheduler_args, sort_keys=True),
            "dump_dir": config.dump_dir,
            "created_at": f"{now:.3f}",
            "entry_id": entry_id,
            "error": "",
            # Bookkeeping: the newest version with every rank's results (see JobState.due),
            # the journal entries the stored snapshot covers, the oldest results kept.
            "complete": "0",
            "snapshot_len": "0",
            "results_floor": "1",
        }
        flat = [x for pair in fields.items() for x in pair]
        names = [keys.job_info(job.job_id), keys.JOBS_INDEX, keys.STARTING_JOBS]
        if request_id:
            names.append(keys.request_job(request_id))
        replied: list[Any] = ["", "", "", ""]
        if answer is not None:
            names += [answer.reply_key, answer.stream]
            replied = [answer.reply, answer.ttl, answer.group, answer.entry_id]
        command = (
            self.scripts.create_job,
            names,
            [job.job_id, now, entry_id, REQUEST_TTL_S, *replied, *flat],
        )

        def finish(reply: Any) -> bool | str:
            created, owner = reply
            if created == 2:
                return str(owner.decode())
            if not created and owner.decode() != entry_id:
                raise ProtocolError(
                    f"job id {job.job_id} is already used by registration {owner.decode()}"
                )
            return bool(created)

        self._add(command, finish)

    def add_rank(
        self,
        job: JobInfo,
        rank: RankInfo,
        now: float,
        credentials: Credentials,
        request_id: str,
        answer: Answer | None = None,
        stamp: bool = True,
    ) -> None:
        """Queue :meth:`JobStore.add_rank` (its fit to the job is checked now).

        Args:
            job: The job.
            rank: The registering rank.
            now: Unix time of the activity.
            credentials: The rank's new token; only its digests are stored
                (:mod:`protocol.tokens`).
            request_id: The registration request: the same request delivered again is
                recognized (:class:`~protocol.exceptions.DuplicateEntryError`).
            answer: A successful registration is also answered and acknowledged by the same
                script.
            stamp: Record the activity in the jobs index (False: the caller did so a moment
                ago, for another rank of the job; a registration burst then skips a write).
        """
        try:
            rank.check_fits(job)
        except ValueError as exc:
            self._fail(ProtocolError(str(exc)))
            return
        names = [*_rank_keys(job.job_id)]
        args = [job.job_id, now, rank.rank, pack_plain(rank), job.world_size]
        args += [credentials.result_key, credentials.beat_digest, request_id, "1" if stamp else "0"]
        if answer is not None:
            names += [answer.reply_key, answer.stream]
            args += [answer.reply, answer.ttl, answer.group, answer.entry_id]
        command = (self.scripts.add_rank, names, args)

        def finish(reply: Any) -> int:
            status, count = reply
            if status == -1:
                raise unknown_job(job.job_id)
            if status == -2:
                raise ProtocolError(
                    f"rank {rank.rank} of job {job.job_id} is already registered with other info"
                )
            if status == -6:
                raise ProtocolError(
                    f"rank {rank.rank} of job {job.job_id} is already registered (a rank "
                    "registers once per job; a restarted training run registers a new job)"
                )
            if status == -7:
                raise DuplicateEntryError(
                    f"registration request {request_id} of rank {rank.rank} was already "
                    "answered (the same entry delivered again, or replayed)"
                )
            return int(count)

        self._add(command, finish)

    def add_result(
        self,
        job: JobInfo,
        result: ProfilingResult,
        now: float,
        data: bytes | None = None,
        source: Source | None = None,
    ) -> None:
        """Queue :meth:`JobStore.add_result` (results of one version share one script call).

        Args:
            job: The job.
            result: The validated result.
            now: Unix time of the activity.
            data: msgpack that holds it as is, stored instead of packing ``result`` again:
                the ``report_result`` message it arrived in (see :func:`stored_result`).
            source: The stream entry it came in: acknowledged by the same script if the
                result is stored (or was already), so the caller acknowledges only refused
                ones (which it dead-letters first).
        """
        if result.rank >= job.world_size:
            self._fail(ProtocolError(f"rank {result.rank} is out of range for job {job.job_id}"))
            return
        version = result.schedule_version
        where = (source.stream, source.group) if source is not None else None
        index = self._result_groups.get((job.job_id, version, where))
        if index is None:
            names = [
                keys.job_info(job.job_id),
                keys.job_ranks(job.job_id),
                keys.job_version(job.job_id),
                keys.job_results(job.job_id, version),
                keys.JOBS_INDEX,
                keys.DUE_JOBS,
            ]
            if source is not None:
                names.append(source.stream)
            group = source.group if source is not None else ""
            self._commands.append(
                (
                    self.scripts.add_results,
                    names,
                    [job.job_id, now, version, job.world_size, group, ""],
                )
            )
            index = self._result_groups[(job.job_id, version, where)] = len(self._commands) - 1
            self._tasks.setdefault(job.job_id, []).append(index)
        args = self._commands[index][2]
        position = (len(args) - 6) // 3
        stored = data if data is not None else pack_plain(result)
        args += [result.rank, stored, source.entry_id if source is not None else ""]

        def finish(reply: Any) -> tuple[bool, int, int]:
            status, latest, count = (int(x) for x in reply[:3])
            added = reply[3:]
            if status == -1:
                raise unknown_job(job.job_id)
            if status == -4:
                raise ProtocolError(
                    f"result for schedule version {version} of job {job.job_id}, but the "
                    f"latest published version is {latest}"
                )
            if status == -5:  # Late, or replayed: its version's results are gone.
                raise ProtocolError(
                    f"result of rank {result.rank} for schedule version {version} of job "
                    f"{job.job_id} came after the scheduler consumed that version's results "
                    "(a late or replayed entry); nothing was changed"
                )
            if added[position] == -3:
                raise ProtocolError(f"rank {result.rank} is not registered with job {job.job_id}")
            if added[position] == -8:
                raise ProtocolError(
                    f"rank {result.rank} already reported a different result for schedule "
                    f"version {version} of job {job.job_id}; the first one stays"
                )
            return added[position] == 1, latest, count

        self._ops.append((index, finish))

    def add_control(self, message: SetTarget, entry_id: str, now: float) -> None:
        """Queue :meth:`JobStore.add_control`."""
        job_id = message.job_id
        command = (
            self.scripts.add_control,
            [keys.job_info(job_id), keys.job_control(job_id), keys.JOBS_INDEX, keys.DUE_JOBS],
            [entry_id, pack(message), job_id, now],
        )

        def finish(reply: Any) -> bool:
            if int(reply) == -1:
                raise unknown_job(job_id)
            if int(reply) == -2:
                raise ProtocolError(
                    f"control message {entry_id} of job {job_id} is older than one already "
                    "applied (it was left pending and handled late); not applied: replay it "
                    "if it should still win"
                )
            return int(reply) == 1

        self._add(command, finish)

    def call(self, script: Script, names: list[str], args: list[Any]) -> None:
        """Queue a read-mostly script whose reply is its outcome."""
        self._add((script, names, args), lambda reply: int(reply))

    def _fail(self, error: Exception) -> None:
        def finish(_reply: Any) -> Any:
            raise error

        self._ops.append((None, finish))

    def execute(
        self,
        then: Callable[[Pipeline], Any] | None = None,
        carry: Callable[[tuple[Any, ...]], Any] | None = None,
    ) -> list[Any]:
        """Send every queued write; return each outcome, or the PerseusError it raised.

        Args:
            then: Queues more commands after the writes, sent with them in one transaction
                (MULTI, called already). :attr:`then_ok` tells whether they all succeeded.
            carry: Sends a lone write (one script call, no ``then``) instead of this batch,
                with whatever the caller sends along in the same write (the coordinator's
                next read); returns its reply, an error reply as the exception.

        Raises:
            redis.RedisError: Redis failed (nothing is known about which writes happened;
                every write is idempotent, so the caller retries them all).
        """
        ops, commands = self._ops, self._commands
        self._ops, self._commands, self._result_groups, self._tasks = [], [], {}, {}
        self.then_ok = False
        replies = self._send(commands, then, carry) if commands else []
        if then is not None and commands:
            extra = replies[len(commands) :]
            self.then_ok = not any(isinstance(r, Exception) for r in extra)
        outcomes: list[Any] = []
        for index, finish in ops:
            reply = replies[index] if index is not None else None
            if isinstance(reply, redis.RedisError):
                raise reply
            try:
                outcomes.append(finish(reply))
            except (ProtocolError, UnknownJobError) as exc:
                outcomes.append(exc)
        return outcomes

    def _send(
        self,
        commands: list[tuple[Script, list[str], list[Any]]],
        then: Callable[[Pipeline], Any] | None = None,
        carry: Callable[[tuple[Any, ...]], Any] | None = None,
    ) -> list[Any]:
        # EVALSHA straight away: redis-py's pipelined scripts would first ask SCRIPT EXISTS,
        # a round trip per batch. A server that lost its scripts (restart) gets them again.
        if then is None and len(commands) == 1:
            script, names, args = commands[0]
            if carry is not None:
                reply = carry(("EVALSHA", script.sha, len(names), *names, *args))
                if not isinstance(reply, NoScriptError):
                    return [reply]
            return [self._send_one(script, names, args)]
        replies = self._pipelined(commands, then)
        failed = [i for i, r in enumerate(replies[: len(commands)]) if isinstance(r, NoScriptError)]
        if not failed:
            return replies
        for script in {id(commands[i][0]): commands[i][0] for i in failed}.values():
            script.sha = self.scripts.conn.script_load(script.script)
        # NOSCRIPT is an error of the call, not of the transaction: Redis ran every other
        # command. Only the failed calls go again (a registration sent twice would find itself
        # answered already), with ``then`` after them: the enqueue that went through ran before
        # these writes, and a second one is harmless (a job's tasks share its lease).
        retried = self._pipelined([commands[i] for i in failed], then)
        for i, reply in zip(failed, retried, strict=False):
            replies[i] = reply
        return replies[: len(commands)] + retried[len(failed) :]

    def _pipelined(
        self,
        commands: list[tuple[Script, list[str], list[Any]]],
        then: Callable[[Pipeline], Any] | None,
    ) -> list[Any]:
        """Send ``commands`` (with ``then``: one transaction) in one pipeline; errors as replies."""
        # With ``then``: one transaction (rq queues its enqueue in an explicit MULTI).
        with self.scripts.conn.pipeline(transaction=then is not None) as pipe:
            if then is not None:
                pipe.multi()
            for script, names, args in commands:
                pipe.evalsha(script.sha, len(names), *names, *args)
            if then is not None:
                then(pipe)
            try:
                return pipe.execute(raise_on_error=False)
            except NoScriptError:
                # Refused while queueing (no server seen does so): nothing ran, all again.
                return [NoScriptError() for _ in commands]

    def _send_one(self, script: Script, names: list[str], args: list[Any]) -> Any:
        """One script call without a pipeline (a registration, say): a pipeline costs more."""
        conn = self.scripts.conn
        try:
            try:
                return conn.evalsha(script.sha, len(names), *names, *args)
            except NoScriptError:
                script.sha = conn.script_load(script.script)
                return conn.evalsha(script.sha, len(names), *names, *args)
        except redis.ResponseError as exc:  # as a pipeline returns it (raise_on_error=False)
            return exc


def single(batch: StoreBatch) -> Any:
    """Execute a batch of one write; return its outcome or raise its error."""
    (outcome,) = batch.execute()
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
