"""One log line when Redis goes away under an rq worker, and one when it answers again.

rq logs ``could not connect to Redis instance`` as an ERROR for every failed reconnect: its
work loop each 1 to 5 s (``perseus worker`` caps rq's wait at 5 s), its pubsub thread each 2 s.
A ten-minute outage wrote hundreds of lines and none said when it ended.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# The format of rq's reconnect message (its work loop's and its pubsub thread's).
RQ_RECONNECT_MSG = "Worker %s: could not connect to Redis instance: %s retrying in %d seconds..."


class OutageLog(logging.LoggerAdapter):
    """rq's worker logger, with its reconnect errors folded into one line per outage.

    Every other record passes through unchanged. The first reconnect error of an outage is
    logged as a warning; the rest go to DEBUG; :meth:`answered` (called once a heartbeat has
    gone through) ends the outage with a line saying how long it lasted.
    """

    def __init__(self, rq_logger: logging.Logger | logging.LoggerAdapter, name: str) -> None:
        """Wrap ``rq_logger`` (the worker's ``log``) for the worker called ``name``."""
        super().__init__(rq_logger, {})
        self.worker_name = name
        self._lock = threading.Lock()  # the work loop and the pubsub thread both log
        self._down_since: float | None = None

    @property
    def level(self) -> int:
        """The wrapped logger's level (rq reads it when it starts its scheduler)."""
        return int(self.logger.level)

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        """Log as rq asked, except a reconnect error while an outage is already logged."""
        if msg != RQ_RECONNECT_MSG or len(args) < 2:
            # The record names rq's line (%(funcName)s, %(lineno)d), not this method: one
            # frame more than logging skips on its own (Python 3.11; 3.10 names this one).
            kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
            self.logger.log(level, msg, *args, **kwargs)
            return
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if first:
            logger.warning(
                "rq worker %s: redis unavailable (%s); retrying until it answers, "
                "logged again when it does",
                self.worker_name,
                args[1],
            )
        else:
            logger.debug("rq worker %s: redis still unavailable (%s)", self.worker_name, args[1])

    def answered(self) -> None:
        """Redis answered: end the outage that was logged, if any, with one line."""
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            logger.warning(
                "rq worker %s: redis answers again after %.1f s",
                self.worker_name,
                time.monotonic() - since,
            )
