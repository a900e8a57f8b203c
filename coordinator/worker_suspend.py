"""`rq suspend` for `perseus worker`: a task taken while workers are suspended goes back.

rq checks for suspension before each wait for a task, not after it. A worker that was already
waiting (every idle one) took the next task and ran it: with workers suspended, a job still got
a new version. Here the wait for a task and the check for suspension go out in one round trip
(BLMOVE, then EXISTS on rq's suspension key); a task taken while suspended is put back at the
head of the queue, and the worker waits for ``rq resume`` as rq's own check does.
"""

from __future__ import annotations

import logging
from typing import Any

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.intermediate_queue import IntermediateQueue
from rq.suspension import WORKERS_SUSPENDED

logger = logging.getLogger(__name__)

# KEYS[1] the queue's intermediate list, KEYS[2] the queue. ARGV[1] the task id. Only a task
# still in the intermediate list goes back (rq's maintenance may have moved it already).
PUT_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


class TakenWhileSuspended(Exception):
    """A task arrived while workers were suspended; it is back at the head of its queue."""


class SuspendAwareQueue(Queue):
    """rq's queue whose blocking dequeue also reads whether workers are suspended."""

    @classmethod
    def lmove(cls, connection: Redis, queue_key: str, timeout: int | None) -> Any:
        """Take a task as rq does (BLMOVE to the intermediate list), unless suspended.

        Raises:
            DequeueTimeout: No task arrived within ``timeout`` (as rq).
            TakenWhileSuspended: One arrived, but workers are suspended: it was put back.
        """
        if timeout is None:  # burst mode: rq's check for suspension came right before
            return super().lmove(connection, queue_key, timeout)
        intermediate = IntermediateQueue(queue_key, connection)
        with connection.pipeline(transaction=False) as pipe:
            pipe.blmove(queue_key, intermediate.key, timeout)
            pipe.exists(WORKERS_SUSPENDED)
            moved, suspended = pipe.execute()
        if moved is None:
            raise DequeueTimeout(timeout, queue_key)
        if suspended:
            task = moved.decode() if isinstance(moved, bytes) else str(moved)
            connection.eval(PUT_BACK, 2, intermediate.key, queue_key, task)
            logger.info("rq task %s arrived while workers are suspended: back in the queue", task)
            raise TakenWhileSuspended(task)
        return queue_key, moved
