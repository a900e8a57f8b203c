"""Training steps on one simulated GPU whose energy counter also runs between steps.

A real GPU's energy counter keeps growing while the GPU idles between two steps; the
simulated GPU's grows only when someone accounts energy. :class:`SimulatedSteps` runs each
step's instructions on a :class:`~worker_client.simulated.gpu.SimulatedGPU` (at the clock the
power limit allows, in real time) and, from a side thread, accounts the table's blocking power
(what the GPU draws while it waits) for the time between steps. So an energy monitor sees the
counter move at every moment, as on a real GPU, and a window that ends between two steps is
resolved at once instead of waiting for the next step (e.g. the power-limit optimizer's
windows, which end at a step's beginning).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import TracebackType

from worker_client.simulated.gpu import InstructionTable, SimulatedGPU


class SimulatedSteps:
    """One training step = ``instructions`` of ``stage`` on simulated GPU ``index``.

    Args:
        index: Simulated device index.
        instructions: Instructions run per step, in order.
        stage: Pipeline stage of the replay table whose instructions run.
        table: Replay table (default: the simulated GPU's synthetic H100 profile); its
            ``blocking_power_w`` is accounted between steps.
        tick: Seconds between two idle accountings.

    """

    def __init__(
        self,
        index: int,
        instructions: Sequence[str] = ("forward", "backward"),
        stage: int = 0,
        table: InstructionTable | None = None,
        tick: float = 0.005,
    ) -> None:
        self.gpu = SimulatedGPU(index, table=table)
        self.instructions = list(instructions)
        self.stage = stage
        self.tick = tick
        self._idle_since = time.perf_counter()
        self._busy = threading.Lock()  # held while a step runs; the idle thread skips then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._idle, name="perseus-sim-idle", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> SimulatedSteps:
        """Start accounting idle power."""
        self._thread.start()
        return self

    def step(self) -> tuple[float, float]:
        """Run one step; return its (time s, energy J) as the simulated GPU replayed them."""
        with self._busy:
            total_t = total_e = 0.0
            for name in self.instructions:
                t, e = self.gpu.run(self.stage, name)
                total_t, total_e = total_t + t, total_e + e
            self._idle_since = time.perf_counter()
        return total_t, total_e

    def _idle(self) -> None:
        self._idle_since = time.perf_counter()
        try:
            while not self._stop.wait(self.tick):
                with self._busy:
                    now = time.perf_counter()
                    seconds, self._idle_since = now - self._idle_since, now
                    self.gpu.idle(seconds)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        """Stop accounting idle power."""
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> SimulatedSteps:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
