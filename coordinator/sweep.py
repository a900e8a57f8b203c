"""The coordinator's periodic sweep: stalled work, idle/finished/unstarted jobs, input stream trims.

It also runs rq's cleanup of started tasks whose worker died (rq's workers run it every ten
minutes, and only while one is alive), judged by Redis's clock, and ends planner runs whose rq
job died.

Its cost does not depend on how many jobs have finished: it reads the due set (jobs with work
outstanding), the idle end of the jobs index, the old ends of the finished and starting sets,
and one page of all jobs per round, which reconciles the due set with the jobs themselves (a
job whose due mark Redis lost is found within jobs / page rounds). Every time it compares is
the Redis server's (heartbeats and activity stamps are), read once per sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from rq import Queue
from rq.job import Job, JobStatus

from coordinator.abandoned import fail_abandoned
from coordinator.health import forget_stale, last_beats
from coordinator.settings import PerseusSettings
from protocol import keys, streams
from protocol.consumers import GroupMembers
from protocol.exceptions import PerseusError
from protocol.job_lifecycle import JobLifecycle
from protocol.job_record import wrong_type
from protocol.store import JobStore
from schedulers.planning.plan_runs import settle_runs

logger = logging.getLogger(__name__)

_WAITING = {JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED}
SWEEP_LIMIT = 1000  # due or idle jobs one sweep looks at, at most
RECONCILE_PAGE = 100  # jobs per sweep checked for work due but missing from the due set
CONSUMER_GONE_AFTER_S = 60.0
"""A group consumer whose coordinator has not beaten (nor read) for this long is removed."""


@contextmanager
def passing_over(job_id: str) -> Iterator[None]:
    """Log a job whose keys cannot be read and go on: one job stops no sweep.

    Services write a job's keys, but on Redis 6.2 a rank may replace those it reads (SET: see
    :mod:`protocol.acl`), with garbage or another type.
    """
    try:
        yield
    except (PerseusError, ValueError, redis.ResponseError) as exc:
        if isinstance(exc, redis.ResponseError) and not wrong_type(exc):
            raise  # NOPERM and the like: the coordinator's own problem, not the job's
        logger.error("job %s: %s; the sweep passes over it", job_id, exc)


class Sweeper:
    """One coordinator's sweeps, with where the next page of the jobs index starts.

    Args:
        store: The job store.
    """

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.lifecycle = JobLifecycle(store)
        self.members = GroupMembers(store.conn)
        self.consumer_gone_after = CONSUMER_GONE_AFTER_S
        self._page_at = 0

    def run(self, settings: PerseusSettings, enqueue: Callable[[str], Any]) -> list[str]:
        """One sweep under ``settings`` (idle time, retentions, stall timeout).

        Args:
            settings: The coordinator's settings now.
            enqueue: Re-enqueues a job's stalled work.

        Returns:
            The jobs deleted (idle, finished or never started).
        """
        now = self.store.server_time()  # also resynchronizes the store's clock
        self._forget_coordinators(now)
        trim_inputs(self.store.conn, settings.stream_hard_cap)
        deleted = self._delete_idle(now, settings.max_job_idle_time)
        deleted += self._delete_ended(now, settings)
        page = self.store.jobs_page(self._page_at, RECONCILE_PAGE)
        self._page_at = self._page_at + len(page) if len(page) == RECONCILE_PAGE else 0
        for job_id in self.store.mark_due(page):
            logger.debug("job %s: due, and now in the due set", job_id)
        for job_id in self.store.due_jobs(SWEEP_LIMIT):
            with passing_over(job_id):
                if self._stalled(job_id, now, settings.stall_timeout):
                    enqueue(job_id)
        self._abandoned_tasks()
        return deleted

    def _abandoned_tasks(self) -> None:
        """Fail rq tasks whose worker died, as rq does, and end planner runs that died.

        Under rq's maintenance lock, which workers take for theirs, a task is abandoned once
        its execution expired in Redis (:func:`coordinator.abandoned.fail_abandoned`); a
        planning task's failure callback then ends its run. :func:`settle_runs` ends runs
        rq's records show dead in any other way (a job stopped, canceled, gone).
        """
        conn = self.store.conn
        queue = Queue(keys.RQ_QUEUE, connection=conn)
        if queue.acquire_maintenance_lock():
            try:
                fail_abandoned(queue)
            finally:
                queue.release_maintenance_lock()
        for plan_id, reason in settle_runs(conn, SWEEP_LIMIT):
            logger.warning("planner run %s: failed: %s", plan_id, reason)

    def _delete_idle(self, now: float, idle_time: int) -> list[str]:
        deleted = []
        for job_id in self.store.idle_jobs(idle_time, now, SWEEP_LIMIT):
            with passing_over(job_id):
                if self._stamp_set_back(job_id, now - idle_time) is not None:
                    continue
                if self.store.delete_job(job_id, idle_before=now - idle_time):
                    deleted.append(job_id)
                    logger.info("deleted job %s: idle for more than %d s", job_id, idle_time)
        return deleted

    def _stamp_set_back(self, job_id: str, cutoff: float) -> float | None:
        """The job's verified activity if it looks idle only because its stamp was set back.

        Every rank may write the jobs index (its heartbeats refresh it), so it is a hint: a
        job active after ``cutoff`` by what no rank can forge
        (:meth:`JobStore.verified_activity`) gets its stamp back and stays (None: it does not).
        """
        last = self.store.verified_activity(job_id)
        if last is None or last <= cutoff:
            return None
        self.store.conn.zadd(keys.JOBS_INDEX, {job_id: last}, xx=True, gt=True)
        logger.warning(
            "job %s: its activity stamp in %s was older than its last verified activity (set "
            "back by someone else, a rank of another job?); stamp restored, job kept",
            job_id,
            keys.JOBS_INDEX,
        )
        return last

    def _forget_coordinators(self, now: float) -> None:
        """Heartbeats and group consumers of coordinators that are gone (none pending)."""
        conn = self.store.conn
        forget_stale(conn, now)
        alive = {n for n, t in last_beats(conn).items() if now - t < self.consumer_gone_after}
        self.members.forget_gone(alive, self.consumer_gone_after)

    def _delete_ended(self, now: float, settings: PerseusSettings) -> list[str]:
        """Jobs finished ``finished_retention`` ago, and never-started ones idle for long."""
        deleted = []
        retention = settings.finished_retention
        for job_id in self.lifecycle.finished_before(now - retention, SWEEP_LIMIT):
            with passing_over(job_id):
                if not self.lifecycle.finish_proven(job_id):
                    self.store.conn.zrem(keys.FINISHED_JOBS, job_id)
                    if self.lifecycle.finish_proven(job_id):
                        # Its last rank finished meanwhile (its mark found ours in place): put back.
                        self.store.conn.zadd(keys.FINISHED_JOBS, {job_id: now}, nx=True)
                        continue
                    logger.warning(
                        "job %s: marked finished in %s without the proof of each of its ranks "
                        "(written by someone else, a rank of another job?); mark removed",
                        job_id,
                        keys.FINISHED_JOBS,
                    )
                    continue
                if self.store.delete_job(job_id):
                    deleted.append(job_id)
                    logger.info("deleted job %s: finished more than %g s ago", job_id, retention)
        cutoff = now - settings.start_retention
        for job_id in self.lifecycle.starting_before(cutoff, SWEEP_LIMIT):
            with passing_over(job_id):
                last = self._stamp_set_back(job_id, cutoff)
                if last is not None:
                    # Looked at again start_retention after its verified activity.
                    self.store.conn.zadd(keys.STARTING_JOBS, {job_id: last}, xx=True)
                    continue
                if self.lifecycle.collect_unstarted(job_id, idle_before=cutoff):
                    deleted.append(job_id)
                    logger.info(
                        "deleted job %s: no schedule version, and idle for more than %g s "
                        "(start_retention)",
                        job_id,
                        settings.start_retention,
                    )
        return deleted

    def _stalled(self, job_id: str, now: float, stall_timeout: float) -> bool:
        """Whether a job in the due set has work due that nobody is doing or will do."""
        if not self.store.settle(job_id):
            return False  # Nothing due (any more): it left the due set.
        fields = self.store.job_fields(job_id, "error", "enqueued_at", "rq_job")
        if fields["error"]:
            # Fails deterministically: only new input (which marks it due) retries it.
            self.store.forget_due(job_id)
            return False
        if self.store.lease_holder(job_id) is not None:
            return False
        enqueued_at = float(fields["enqueued_at"] or 0)
        if now - enqueued_at < stall_timeout:
            return False
        rq_id = fields["rq_job"]
        if rq_id and self._rq_waiting(rq_id):
            return False  # Still in the queue: a worker will get to it.
        logger.warning(
            "job %s: due work unclaimed for %.1f s; enqueueing again", job_id, now - enqueued_at
        )
        return True

    def _rq_waiting(self, rq_id: str) -> bool:
        try:
            status = Job.fetch(rq_id, connection=self.store.conn).get_status()
        except Exception:  # rq raises NoSuchJobError and friends: treat as gone.
            return False
        if status == JobStatus.QUEUED:
            # A worker killed between taking the job and starting it leaves it "queued" but
            # out of the queue (in rq's intermediate list) until rq's maintenance, 10+ minutes
            # later: only a job still in the queue is waiting.
            queue = Queue(keys.RQ_QUEUE, connection=self.store.conn)
            return self.store.conn.lpos(queue.key, rq_id) is not None
        return status in _WAITING


def trim_inputs(conn: redis.Redis, hard_cap: int) -> int:
    """Trim each input stream by acknowledgement and enforce ``hard_cap``; return entries lost.

    Logs a warning for each entry the cap removes unread, and for each gap found. The
    dead-letter stream is capped too (its entries go when replayed or purged).
    """
    lost = 0
    for stream in keys.INPUT_STREAMS:
        done = streams.trim_acknowledged(conn, stream, keys.COORDINATOR_GROUP, hard_cap)
        if done.trimmed:
            logger.debug("%s: trimmed %d acknowledged entries", stream, done.trimmed)
        for entry_id in done.cut:
            logger.warning(
                "LOST entry %s %s: removed unread by stream_hard_cap=%d (PERSEUS_STREAM_HARD_CAP);"
                " counted in %s",
                stream,
                entry_id,
                hard_cap,
                keys.STREAM_LOSSES,
            )
        if done.gap:
            logger.warning(
                "LOST %d entries of %s: removed unread by someone else (a gap after %s, seen "
                "in the consumer group's lag); counted in %s",
                done.gap,
                stream,
                done.last_delivered,
                keys.STREAM_LOSSES,
            )
        lost += len(done.cut) + done.gap
    cut, newest = streams.cap_dead_letters(conn, hard_cap)
    if cut:
        logger.warning(
            "LOST %d dead letters, the oldest (up to %s): over stream_hard_cap=%d "
            "(PERSEUS_STREAM_HARD_CAP); counted in %s",
            cut,
            newest,
            hard_cap,
            keys.STREAM_LOSSES,
        )
    return lost + cut
