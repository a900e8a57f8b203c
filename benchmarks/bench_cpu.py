"""CPU time of processes from /proc, and what turns of a benchmark cost them (Linux only)."""

from __future__ import annotations

import os
import resource
import time


def cpu_seconds(pid: int | None = None, children: bool = False) -> float:
    """CPU time (user + system) of process ``pid`` so far (default: this one); Linux only.

    With ``children``, also that of its children it has waited for (a forking worker's tasks).
    """
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


class Turns:
    """Wall time and CPU of some processes summed over the turns (``with turns:``) they took.

    Args:
        pids: The processes (None: this one); ``cpu[i]`` is ``pids[i]``'s.
    """

    def __init__(self, pids: tuple[int | None, ...]) -> None:
        self.pids = pids
        self.wall = 0.0
        self.cpu = [0.0] * len(pids)

    def __enter__(self) -> Turns:
        self._cpu = [cpu_seconds(pid) for pid in self.pids]
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._start
        for i, pid in enumerate(self.pids):
            self.cpu[i] += cpu_seconds(pid) - self._cpu[i]
