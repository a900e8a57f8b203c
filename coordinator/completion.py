"""Which job versions a batch of results completes, guessed before the batch is written.

The coordinator learns that a version is complete from the store's reply, and only then could
it enqueue the scheduler work: a round trip, and its own bookkeeping, between the last result
and a worker starting. With a guess it enqueues the work in the round trip that writes the
results (after them, on the same connection, so the worker finds them stored). A wrong guess
costs a task that finds nothing due; a missed one falls back to enqueueing after the reply.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from protocol.job_record import JobRecord
from protocol.models import JobInfo, ProfilingResult, ReportResult

_JOBS = 10_000  # jobs whose latest counts a coordinator remembers


class CompletionGuess:
    """Results counted per job for its latest version, as the store last replied."""

    def __init__(self, capacity: int = _JOBS) -> None:
        self.capacity = capacity
        self._counts: OrderedDict[str, tuple[int, int]] = OrderedDict()  # job -> (latest, n)

    def record(self, job_id: str, latest: int, count: int) -> None:
        """What the store replied to a result of ``job_id``: latest version, results of it."""
        known = self._counts.get(job_id)
        if known is None or (latest, count) > known:
            self._counts[job_id] = (latest, count)
        self._counts.move_to_end(job_id)
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)

    def forget(self, job_id: str) -> None:
        """Drop what is known of a job (deleted, say)."""
        self._counts.pop(job_id, None)

    def completed(self, results: list[tuple[JobInfo, ProfilingResult]]) -> list[str]:
        """Jobs whose latest version these results (about to be written) likely complete.

        A job counts when the ranks reporting its latest known version here, with the
        results the store counted before, make up its world size; for a job not seen yet,
        when this batch alone holds a result of every rank for one version.
        """
        ranks: dict[tuple[str, int], set[int]] = {}
        infos: dict[str, JobInfo] = {}
        for info, result in results:
            infos[info.job_id] = info
            ranks.setdefault((info.job_id, result.schedule_version), set()).add(result.rank)
        done = []
        for (job_id, version), reported in ranks.items():
            known = self._counts.get(job_id)
            if known is not None and version < known[0]:
                continue  # late results of an older version
            # A newer version than the one known was published since: none counted yet.
            before = known[1] if known is not None and version == known[0] else 0
            if before < infos[job_id].world_size <= before + len(reported):
                done.append(job_id)
        return sorted(set(done))

    def completes_all(self, messages: Iterable[object], jobs: Mapping[str, JobRecord]) -> bool:
        """Whether the results among ``messages`` likely complete every version they are for.

        The coordinator stops gathering a burst then: the read that would find nothing more
        is a round trip on the way to the next version.

        Args:
            messages: Decoded entries (anything that is not a result is left out).
            jobs: Known jobs by id; a result of a job not in it makes the answer False.
        """
        reports = []
        for message in messages:
            if isinstance(message, ReportResult):
                record = jobs.get(message.job_id)
                if record is None:
                    return False  # Its world size is not known here.
                reports.append((record.info, message.result))
        wanted = {info.job_id for info, _ in reports}
        return bool(wanted) and len(self.completed(reports)) == len(wanted)
