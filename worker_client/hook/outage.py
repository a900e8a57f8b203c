"""A background thread's view of a Redis outage: when it began, what to say, when to give up."""

from __future__ import annotations

import logging
import time

from protocol.acl import refused
from protocol.exceptions import CoordinatorUnavailableError
from worker_client.hook.session import FIRST_RETRY_S, LAST_RETRY_S

logger = logging.getLogger(__name__)


class Outage:
    """One background thread's view of a Redis outage: when it began, and when to give up.

    Args:
        what: Names the thread in log messages.
        redis_url: Names the server in log messages and errors.
        timeout: Seconds of continuous outage after which :meth:`failed` returns an error;
            ``None`` never gives up.
    """

    def __init__(self, what: str, redis_url: str, timeout: float | None) -> None:
        self.what, self.redis_url, self.timeout = what, redis_url, timeout
        self.since: float | None = None
        self.count = 0  # outages seen so far
        self.refused = False  # this outage includes a refusal (login or ACL), said once
        self._delay = FIRST_RETRY_S

    def failed(self, exc: BaseException) -> CoordinatorUnavailableError | None:
        """Note a failed call; returns the error to raise once the outage lasted too long.

        A refusal (a wrong password, a disabled user, an ACL without a command the hook needs)
        is retried as well, since only Redis's operator can cure it and may do so while the
        training runs, but it is said as what it is, once, as an error.
        """
        now = time.monotonic()
        refusal = refused(exc)
        if self.since is None:
            self.since = now
            self.count += 1
            if not refusal:
                logger.warning(
                    "%s: redis at %s unavailable (%s); training goes on with the current "
                    "schedule while this retries",
                    self.what,
                    self.redis_url,
                    exc,
                )
        if refusal and not self.refused:
            self.refused = True
            logger.error(
                "%s: redis at %s refused this client (%s): not an outage; check the user name "
                "and password in redis_url and the server's ACL users (`perseus acl`). "
                "Training goes on with the current schedule while this retries",
                self.what,
                self.redis_url,
                exc,
            )
        if self.timeout is not None and now - self.since > self.timeout:
            why = "refusing this client" if self.refused else "unreachable"
            return CoordinatorUnavailableError(
                f"{self.what}: redis at {self.redis_url} {why} for "
                f"{now - self.since:.1f} s (outage_timeout={self.timeout:g} s): {exc}"
            )
        return None

    def backoff(self) -> float:
        """Seconds to wait before the next try: doubling from 0.5 s up to 5 s."""
        delay, self._delay = self._delay, min(self._delay * 2, LAST_RETRY_S)
        return delay

    def recovered(self) -> bool:
        """Note a successful call; True if it ended an outage."""
        self._delay = FIRST_RETRY_S
        self.refused = False
        if self.since is None:
            return False
        logger.warning(
            "%s: redis at %s is back after %.1f s",
            self.what,
            self.redis_url,
            time.monotonic() - self.since,
        )
        self.since = None
        return True
