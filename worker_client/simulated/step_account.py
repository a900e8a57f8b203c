"""Per-step bookkeeping of a simulated rank: its clock, iteration time and energy, stopping.

Shared by both ways a simulated rank trains (:mod:`worker_client.simulated.training`'s own
loop and torch's pipeline schedules, :mod:`worker_client.simulated.pipelining`).
"""

from __future__ import annotations

import glob
import time
from typing import Any, Literal

Timing = Literal["virtual", "wall"]

_FIGURES = ("iter_time", "iter_energy", "compute_time", "compute_energy", "idle_energy")


class SimClock:
    """The hook's clock: simulated (profile-unit) time, or scaled wall time."""

    def __init__(self, timing: Timing, time_scale: float) -> None:
        self.virtual = timing == "virtual"
        self.scale = time_scale
        self.t = 0.0  # Simulated seconds (virtual timing only).

    def now(self) -> float:
        """Seconds, in profile units."""
        return self.t if self.virtual else time.perf_counter() / self.scale

    def advance(self, seconds: float) -> None:
        """An instruction of ``seconds`` (profile units) ran."""
        self.t += seconds

    def catch_up(self, other: float) -> None:
        """A message sent at the other rank's clock ``other`` was received."""
        self.t = max(self.t, other)


class StepAccount:
    """Iteration time and energy of each step of one simulated rank.

    Per step: :meth:`begin` (before the hook's step begins), :meth:`add` per instruction,
    :meth:`sync` once every instruction ran (before the hook's step ends), then :meth:`end`.

    Args:
        gpu: The rank's :class:`~worker_client.simulated.gpu.SimulatedGPU`.
        clock: The rank's clock.
        stop_file: Stop once this file exists, or a file matches this glob pattern (every
            rank decides at the same step).
        steps_after_stop: Steps still run after the stop file appeared.

    """

    def __init__(
        self, gpu: Any, clock: SimClock, stop_file: str | None = None, steps_after_stop: int = 0
    ) -> None:
        self.gpu, self.clock = gpu, clock
        self.stop_file, self.steps_after_stop = stop_file, steps_after_stop
        self.figures: dict[str, list[float]] = {k: [] for k in _FIGURES}
        self.versions: list[int] = []
        self.schedules: dict[str, list[tuple[str, int]]] = {}
        self._stop_in: int | None = None
        self._stop_seen = False

    def begin(self, hook: Any) -> None:
        """A step starts under the hook's current schedule."""
        self.versions.append(hook.schedule.version)
        # String keys, as the records read back from JSON have them.
        self.schedules.setdefault(str(hook.schedule.version), hook.schedule.frequencies)
        self._energy_start = self.gpu.energy_mj() / 1000.0
        self._start = self.clock.now()
        self._compute_t = self._compute_e = 0.0

    def add(self, seconds: float, joules: float) -> None:
        """An instruction ran."""
        self._compute_t += seconds
        self._compute_e += joules

    def sync(self) -> None:
        """End the iteration with every rank of the job, as a gradient sync would.

        The iteration ends for everyone when the slowest rank is done (gradient sync and
        optimizer step); the stop decision travels along so that all ranks stop together.
        The GPU idles at its blocking power for the part of the iteration it did not compute.
        """
        import torch  # torch: only in the rank processes
        import torch.distributed as dist

        seen = self.stop_file is not None and bool(glob.glob(self.stop_file))
        sync = torch.tensor([self.clock.now(), float(seen)], dtype=torch.float64)
        dist.all_reduce(sync, op=dist.ReduceOp.MAX)
        self.clock.catch_up(float(sync[0]))
        self._stop_seen = bool(sync[1] > 0)
        self._iter_time = self.clock.now() - self._start
        self._idle_e = self.gpu.idle(max(0.0, self._iter_time - self._compute_t))

    def end(self) -> bool:
        """Record the step's figures; return whether to stop now."""
        energy_end = self.gpu.energy_mj() / 1000.0
        for key, value in (
            ("iter_time", self._iter_time),
            ("iter_energy", energy_end - self._energy_start),
            ("compute_time", self._compute_t),
            ("compute_energy", self._compute_e),
            ("idle_energy", self._idle_e),
        ):
            self.figures[key].append(value)
        if self._stop_in is None and self._stop_seen:
            self._stop_in = self.steps_after_stop
        elif self._stop_in is not None:
            self._stop_in -= 1
        return self._stop_in is not None and self._stop_in <= 0

    def record(self, hook: Any) -> dict[str, Any]:
        """Per-step figures and what the hook did, for the rank's record."""
        # The last step end may have swapped in a version no step ran yet: record it too.
        self.schedules.setdefault(str(hook.schedule.version), hook.schedule.frequencies)
        return {
            **self.figures,
            "schedules": self.schedules,
            "version": self.versions,
            "swaps": list(hook.swaps),
            "final_version": hook.schedule.version,
            "reports_sent": hook.reporter.sent,
            "reports_unsent": hook.reporter.unsent,
        }
