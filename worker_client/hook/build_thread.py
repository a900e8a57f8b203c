"""The hook's result-building thread: runs calls in order, off the training thread, as a daemon."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class BuildThread:
    """One daemon thread that runs the calls given to :meth:`submit`, one at a time, in order.

    What a one-worker ``ThreadPoolExecutor`` did, but a daemon: an executor's worker is not
    one, and if a signal's exception (SIGTERM as KeyboardInterrupt) landed while ``submit``
    started it, the executor never learnt of its thread and never told it to end, so the
    interpreter waited for it at exit for ever. A daemon never holds the process; the hook's
    close at exit still flushes what was submitted (:meth:`shutdown`).

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None]
        self._calls = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[..., Any], *args: Any) -> None:
        """Run ``call(*args)`` after the calls submitted before it.

        Raises:
            RuntimeError: After :meth:`shutdown`.
        """
        if self._closed:
            raise RuntimeError("the result-building thread is shut down")
        self._calls.put((call, args))

    def shutdown(self, wait: bool = True) -> None:
        """Run what was submitted, then end the thread (idempotent).

        Args:
            wait: Wait until the calls submitted have run.
        """
        if not self._closed:
            self._closed = True
            self._calls.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            call, args = item
            try:
                call(*args)
            except Exception:  # the caller records its own errors: this one escaped it
                logger.exception("result-building call %s failed", getattr(call, "__name__", call))
