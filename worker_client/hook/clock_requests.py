"""Clock requests that wait for the GPU on a side thread instead of the training thread."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from protocol.exceptions import GPUError

logger = logging.getLogger(__name__)


class Marker(Protocol):
    """A point in the GPU's queued work (a recorded ``torch.cuda.Event``)."""

    def synchronize(self) -> None:
        """Wait until the GPU has done everything queued before this point."""


class ClockSetter(Protocol):
    """The part of a frequency controller that requests a clock."""

    def set_frequency(self, frequency: int) -> None:
        """Request ``frequency`` MHz for what runs next."""


class FrequencySetter(ClockSetter, Protocol):
    """What the hook needs from a frequency controller."""

    def stop(self) -> None:
        """Stop controlling and restore the default clocks."""


def cuda_sync(device_id: int) -> Callable[[], None]:
    """Waits for CUDA device ``device_id``'s queued work (does nothing without CUDA)."""
    if torch.cuda.is_available():
        return lambda: torch.cuda.synchronize(device_id)
    return lambda: None


def cuda_marker() -> Marker:
    """A CUDA event recorded on the current stream; waiting on it sleeps rather than spins.

    It marks the work queued on the current stream only (``clock_sync="wait"`` waits for every
    stream of the device).
    """
    event = torch.cuda.Event(blocking=True)
    event.record()
    return event


_Request = tuple[Marker | None, int | None, threading.Event | None]


class ClockRequester(threading.Thread):
    """Requests each clock once the GPU has finished the work queued before its marker.

    The training thread records a marker where the clock must change (the end of what it has
    queued on its stream so far) and hands it over with :meth:`request`; it never waits for the
    GPU. This thread waits for each marker in order and only then calls the controller, so work
    queued earlier still runs at the clock planned for it. It is the controller's only caller,
    as a :class:`~worker_client.gpu.frequency.FrequencyController` wants one thread.

    An error stops further requests (they are dropped) and is kept in :attr:`error`: the
    training thread raises it.

    Args:
        controller: Where the clocks are requested.
    """

    def __init__(self, controller: ClockSetter) -> None:
        super().__init__(name="perseus-clock-requests", daemon=True)
        self._controller = controller
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.error: Exception | None = None
        self.applied = 0  # requests passed to the controller
        self._cancelled = False  # set by stop() when a marker was never reached
        self._calling = threading.Lock()  # held while the controller is called
        # Held while a request is queued, and while stop() queues its end: nothing is
        # queued behind the end, where no thread would serve (or release) it.
        self._queueing = threading.Lock()
        self._stopped = False

    def request(self, frequency: int, marker: Marker | None, wait: bool = False) -> None:
        """Request ``frequency`` once ``marker`` is reached (at once if ``None``).

        Args:
            frequency: Clock, MHz.
            marker: Where in the queued work the clock changes.
            wait: Return only once the controller was called, after every earlier request
                (where the next instruction is timed).

        Raises:
            Exception: With ``wait``, the error of this or an earlier request.
        """
        self._put(marker, frequency, wait)

    def flush(self) -> None:
        """Return once every earlier request reached the controller (after a GPU sync: at once).

        Raises:
            Exception: The error of an earlier request.
        """
        self._put(None, None, True)

    def _put(self, marker: Marker | None, frequency: int | None, wait: bool) -> None:
        done = threading.Event() if wait else None
        with self._queueing:
            if self._stopped:  # the hook was closed, from another thread say
                raise GPUError("clock requests have stopped (the hook was closed)")
            self._queue.put((marker, frequency, done))
        if done is not None:
            done.wait()
            if self.error is not None:
                raise self.error

    def run(self) -> None:
        """Serve requests in order until :meth:`stop`."""
        while (item := self._queue.get()) is not None:
            marker, frequency, done = item
            try:
                if self.error is None:
                    if marker is not None:
                        marker.synchronize()
                    with self._calling:
                        if frequency is not None and not self._cancelled:
                            self._controller.set_frequency(frequency)
                            self.applied += 1
            except Exception as exc:  # raised on the training thread by the hook
                # Also logged: a failure after the last step end is raised nowhere.
                logger.warning("clock request of %s MHz failed: %s", frequency, exc)
                self.error = exc
            finally:
                if done is not None:
                    done.set()

    def stop(self, timeout: float = 10.0) -> bool:
        """Serve what was requested, then end; return whether the thread ended.

        Waits at most ``timeout`` for the GPU to reach the last marker; past that, the requests
        left are dropped (the controller may be stopped next and must have no second caller).
        """
        with self._queueing:
            self._stopped = True
            if self.is_alive():
                self._queue.put(None)
        if self.is_alive():
            self.join(timeout)
        if self.is_alive():
            with self._calling:
                self._cancelled = True
            logger.warning(
                "the GPU did not reach a clock change within %.0f s; requests left are dropped",
                timeout,
            )
            return False
        return True
