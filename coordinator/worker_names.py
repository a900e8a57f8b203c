"""Whose an rq worker name is: which process a worker record names, and taking over a dead one's.

A worker killed with SIGKILL leaves its record (``rq:worker:<name>``) until its TTL runs out,
and rq refuses a new worker of that name meanwhile. Each perseus worker's record says which
process it is (:func:`process_identity`), so that a worker restarted under the same name can
tell the old one is dead and take the name over (:func:`claim_name`).
"""

from __future__ import annotations

import logging
import os
from datetime import datetime
from typing import Any

import redis
from rq import worker_registration
from rq.utils import now, utcformat
from rq.worker import BaseWorker

from protocol.exceptions import ConfigError

logger = logging.getLogger(__name__)

#: Field of the worker's rq record naming its process beyond rq's pid and hostname
#: (:func:`process_identity`), so that a restarted worker can tell the old one is dead.
PROCESS_FIELD = "perseus_process"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command (which may hold spaces), [] if none."""
    stat = _read(f"/proc/{pid}/stat")
    return [] if stat is None else stat.rpartition(")")[2].split()


def _start_ticks(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (/proc), None if none."""
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 else None  # starttime is field 22


def process_identity(pid: int | None = None) -> str | None:
    """``<boot id>/<pid namespace>/<pid>/<start ticks>`` of a process of this PID namespace.

    Two records with the same boot id and namespace name processes of the same kernel that see
    the same PIDs; the start time tells a reused PID from the process that had it. None where
    /proc cannot tell (not Linux).
    """
    pid = os.getpid() if pid is None else pid
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    start = _start_ticks(pid)
    if boot is None or start is None:
        return None
    return f"{boot.strip()}/{namespace}/{pid}/{start}"


def process_gone(identity: str) -> bool:
    """Whether the process that :func:`process_identity` named has certainly ended.

    Only a process of this machine's boot and this PID namespace can be checked: for any other
    (another host, another container, an older record without the field) this says False.
    """
    parts = identity.split("/")
    mine = process_identity()
    if len(parts) != 4 or mine is None or mine.split("/")[:2] != parts[:2]:
        return False
    try:
        pid = int(parts[2])
    except ValueError:
        return False
    try:
        os.kill(pid, 0)  # sends nothing: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists (another user's): its start time tells whether it is the same one
    if _stat_fields(pid)[:1] in (["Z"], ["X"]):
        return True  # ended, not yet reaped by its parent (a SIGKILLed worker, for a moment)
    start = _start_ticks(pid)
    # Unreadable (/proc mounted hidepid, say): it may be alive. A new start time: PID reused.
    return start is not None and start != parts[3]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def claim_name(worker: BaseWorker) -> None:
    """Let ``worker`` register its name: take it over from a dead worker, or refuse with advice.

    rq refuses a worker whose name a live-looking record holds (``rq:worker:<name>`` without a
    ``death`` field), and a worker killed with SIGKILL leaves one until its TTL runs out. The
    name is taken over (rq's record of the old worker's death is written, and a warning
    logged) only when that worker's process was on this machine and PID namespace and has
    ended (:func:`process_gone`), or is this process (an earlier worker of
    :func:`coordinator.worker_loop.run_workers` whose death an outage kept from being
    recorded): a worker elsewhere is never taken for dead.

    Raises:
        ConfigError: The name is registered by a worker that may be alive: the error names the
            key, when it expires and what to do.
    """
    conn = worker.connection
    for _ in range(3):  # WATCH: another worker may register or die meanwhile
        with conn.pipeline() as pipe:
            try:
                pipe.watch(worker.key)
                record = {_text(k): _text(v) for k, v in pipe.hgetall(worker.key).items()}
                if not record or "death" in record:
                    return  # rq lets a dead or absent worker's name be taken
                identity = record.get(PROCESS_FIELD)
                who = f"pid {record.get('pid', '?')} on host {record.get('hostname', '?')}"
                ours = identity is not None and identity == process_identity()
                if not ours and (identity is None or not process_gone(identity)):
                    alive = identity is not None and identity == _alive_here(identity)
                    raise _name_taken(worker, record, who, int(pipe.ttl(worker.key)), alive)
                pipe.multi()
                worker_registration.unregister(worker, pipe)
                pipe.hset(worker.key, "death", utcformat(now()))
                pipe.expire(worker.key, 60)
                pipe.execute()
            except redis.WatchError:
                continue
        why = (
            "is an earlier worker of this process whose death was not recorded"
            if ours
            else "is dead: its process is gone"
        )
        logger.warning(
            "rq worker %s: the worker registered under this name (%s) %s; recorded its death "
            "in %s and taking over the name",
            worker.name,
            who,
            why,
            worker.key,
        )
        return
    raise ConfigError(f"rq worker {worker.name}: {worker.key} kept changing; try again")


def _alive_here(identity: str) -> str | None:
    """``identity`` if it names a process of this machine and PID namespace that runs now."""
    parts = identity.split("/")
    try:
        return process_identity(int(parts[2])) if len(parts) == 4 else None
    except ValueError:
        return None


def _name_taken(
    worker: BaseWorker, record: dict[str, str], who: str, ttl: int, alive: bool = False
) -> ConfigError:
    try:
        beat = datetime.fromisoformat(record.get("last_heartbeat", ""))
        ago = f", last heartbeat {(now() - beat).total_seconds():.0f} s ago"
    except (TypeError, ValueError):  # no or an odd time: leave it out
        ago = ""
    expires = f"expires in {ttl} s unless it beats again" if ttl >= 0 else "never expires"
    return ConfigError(
        f"rq worker name {worker.name!r} is taken: Redis key {worker.key} registers a worker "
        f"({who}{ago}) that "
        + (
            "is running (its process is alive on this machine); start this worker with another "
            "--name, or stop that one first"
            if alive
            else f"may still be running; the key {expires}. Start this worker with another "
            f"--name, or, if you know that worker is dead, delete its registration: "
            f"redis-cli DEL {worker.key}"
        )
    )
