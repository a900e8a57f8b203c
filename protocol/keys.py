"""Every Redis key, stream, group and queue name used by perseus-mq, built in one place.

All names start with ``perseus:`` and use ``:`` as separator so that they read well in
``redis-cli`` (``SCAN 0 MATCH perseus:* COUNT 1000``). The README's "Redis key layout" table
documents each of them; keep the two in sync.

Job ids never contain ``:`` (see :func:`protocol.job_record.make_job_id`), so a key such as
``perseus:job:<job_id>:schedule:3`` splits unambiguously.
"""

from __future__ import annotations

PREFIX = "perseus"

# Streams the ranks write to and the coordinator reads from (one consumer group).
REGISTRATIONS_STREAM = f"{PREFIX}:stream:registrations"
RESULTS_STREAM = f"{PREFIX}:stream:results"
CONTROL_STREAM = f"{PREFIX}:stream:control"
INPUT_STREAMS = (REGISTRATIONS_STREAM, RESULTS_STREAM, CONTROL_STREAM)
COORDINATOR_GROUP = "perseus-coordinators"

# Hash: input stream name -> entries lost from it unread (removed before the coordinators
# acknowledged them: trimmed while pending, cut by the hard cap, or a gap Redis 7 reports);
# the dead-letter stream -> dead letters cut by the hard cap before anyone handled them;
# ``gapmark:<stream>`` -> the part of the group's lag already counted (coordinator-internal).
STREAM_LOSSES = f"{PREFIX}:streams:lost"

# Malformed or rejected entries, with the reason and the original fields.
DEADLETTER_STREAM = f"{PREFIX}:stream:deadletter"

# Sorted set: job id -> Redis server time (unix s) of its last activity (`perseus status`, GC).
JOBS_INDEX = f"{PREFIX}:jobs"

# Sorted set: job id -> Redis server time at which every rank had finished (or an operator
# ran ``perseus jobs finish``). The sweep deletes jobs older than ``finished_retention``.
FINISHED_JOBS = f"{PREFIX}:jobs:finished"

# Sorted set: job id -> Redis server time of its registration, for jobs that may not have
# started yet (no schedule version published). The sweep deletes those still without a version
# and idle for ``start_retention``, and drops the others from the set.
STARTING_JOBS = f"{PREFIX}:jobs:starting"

# Hash: coordinator consumer name (``<host>-<pid>``) -> Redis server time of its last loop round
# (the container healthcheck, coordinator/health.py).
COORDINATORS = f"{PREFIX}:coordinators"
# Hash: coordinator consumer name -> JSON of the settings coordinators must agree on.
COORDINATOR_SETTINGS = f"{PREFIX}:coordinators:settings"

# Sorted set: job id -> unix time its next version became due. Holds only jobs with scheduler
# work outstanding, so the coordinator's sweep costs nothing per finished job.
DUE_JOBS = f"{PREFIX}:due"

# The rq queue that runs scheduler work (rq stores it as ``rq:queue:perseus``).
RQ_QUEUE = PREFIX

# Sorted set: workload -> unix time its power-limit profile was last written.
POWER_LIMIT_INDEX = f"{PREFIX}:powerlimit:index"

# Planner runs enqueued with ``perseus optimize --enqueue``.
PLANS_INDEX = f"{PREFIX}:plans"
# Sorted set: planner run id -> enqueue time, for runs not ended yet (queued or running): the
# coordinator's sweep checks only these against rq, so its cost does not grow with old runs.
PLANS_ACTIVE = f"{PREFIX}:plans:active"


def job_key(job_id: str, *parts: str | int) -> str:
    """Return ``perseus:job:<job_id>[:part...]``."""
    suffix = "".join(f":{p}" for p in parts)
    return f"{PREFIX}:job:{job_id}{suffix}"


def job_info(job_id: str) -> str:
    """Hash of the job's info and configuration (plain strings, readable with HGETALL)."""
    return job_key(job_id, "info")


def job_ranks(job_id: str) -> str:
    """Hash: rank -> msgpack RankInfo."""
    return job_key(job_id, "ranks")


def job_tokens(job_id: str) -> str:
    """Hash: rank -> SHA-256 of its token (64 hex) followed by the registering request id.

    The HMAC key of the rank's results (:mod:`protocol.tokens`). Services only: no rank ACL
    pattern matches it.
    """
    return job_key(job_id, "tokens")


def job_beatcheck(job_id: str) -> str:
    """Hash: rank -> SHA-1 of its token; the heartbeat script (run by ranks) checks it."""
    return job_key(job_id, "beatcheck")


def job_version(job_id: str) -> str:
    """String: the latest published schedule version (absent until the first one)."""
    return job_key(job_id, "version")


def job_schedule(job_id: str, version: int) -> str:
    """Hash: rank -> msgpack FrequencySchedule of one schedule version."""
    return job_key(job_id, "schedule", version)


def job_schedule_draft(job_id: str, version: int, nonce: str) -> str:
    """Hash: a wide version's schedules while a worker writes them, in chunks.

    The publish script renames it to :func:`job_schedule` (or deletes it, if another worker
    published first); it expires a minute after its last chunk should its worker die first.
    """
    return job_key(job_id, "schedule", version, "draft", nonce)


def job_results(job_id: str, version: int) -> str:
    """Hash: rank -> ProfilingResult measured while running ``version``.

    The value is the msgpack ``report_result`` message the rank sent (validated, stored as it
    arrived), or a msgpack ProfilingResult; ``protocol.job_record.stored_result`` reads both.
    """
    return job_key(job_id, "results", version)


def job_updates(job_id: str) -> str:
    """Stream of published versions; clients block on it instead of polling."""
    return job_key(job_id, "updates")


def job_journal(job_id: str) -> str:
    """List of msgpack JournalEntry, one per published version (scheduler replay log)."""
    return job_key(job_id, "journal")


def job_artifacts(job_id: str) -> str:
    """Hash: name -> bytes a scheduler produced (e.g. ``profile.csv`` of the profiler)."""
    return job_key(job_id, "artifacts")


def job_summaries(job_id: str) -> str:
    """Hash: version -> msgpack summary of its results (kept after a snapshot deletes them)."""
    return job_key(job_id, "summaries")


def job_snapshot(job_id: str) -> str:
    """String: msgpack scheduler state after a prefix of the journal (see coordinator.replay)."""
    return job_key(job_id, "snapshot")


def job_alive(job_id: str) -> str:
    """Sorted set: ``<rank>:<proof>`` -> Redis server time (s) of its last heartbeat.

    Drives ALIVE in ``perseus status``; an entry without the rank's proof is ignored.
    """
    return job_key(job_id, "alive")


def job_finished(job_id: str) -> str:
    """Set of ``<rank>:<proof>`` of the ranks whose hook closed; all of them: job finished."""
    return job_key(job_id, "finished")


def job_lease(job_id: str) -> str:
    """String with a TTL, held by the rq worker that is advancing the job."""
    return job_key(job_id, "lease")


def job_control(job_id: str) -> str:
    """Stream of control messages (new target iteration times); entry ids = source ids."""
    return job_key(job_id, "control")


def reply_key(request_id: str) -> str:
    """List the coordinator pushes a request's reply to (short TTL)."""
    return f"{PREFIX}:reply:{request_id}"


def request_job(request_id: str) -> str:
    """String: the job id a ``register_job`` request created (a day's TTL; retries reuse it)."""
    return f"{PREFIX}:request:{request_id}"


def power_limit_profile(workload: str) -> str:
    """String: msgpack power-limit profile of a workload."""
    return f"{PREFIX}:powerlimit:profile:{workload}"


def plan_key(plan_id: str, *parts: str) -> str:
    """Return ``perseus:plan:<plan_id>[:part...]`` (planner progress and result)."""
    suffix = "".join(f":{p}" for p in parts)
    return f"{PREFIX}:plan:{plan_id}{suffix}"


def plan_rq_job(plan_id: str) -> str:
    """The rq job id of a planner run, ``perseus-plan-<plan_id>`` (rq's ``rq:job:<that>``)."""
    return f"{PREFIX}-plan-{plan_id}"
