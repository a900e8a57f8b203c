"""What the hook costs the training thread and Redis: GPU syncs, NVML reads, idle watcher reads."""

from __future__ import annotations

import time

from protocol.models import JobConfig, JobInfo
from protocol.store import JobStore
from tests.helpers import wait_for
from tests.rank_helpers import make_hook, run_step
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.gpu.nvml import NVML, SIMULATED_NVML
from worker_client.hook.energy_source import (
    CounterEnergySource,
    MonitorEnergySource,
    default_energy_source,
)
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import ScheduleWatcher

INSTRUCTIONS = 4  # run_step's forward, backward, forward, backward


def test_gpu_syncs_only_for_measurements_and_clock_changes(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    calls = [0]

    def sync() -> None:
        calls[0] += 1

    hook = make_hook(redis_url, DryRunFrequencyController(0), report_every=1, sync_fn=sync)
    steps: list[tuple[int, bool, int]] = []  # (version, measured, syncs)
    try:
        deadline = time.monotonic() + 20
        while hook.schedule.version < 3 or not any(not m for _, m, _ in steps):
            assert time.monotonic() < deadline, f"no version 3 after 20 s: {steps}"
            before, version, measured = calls[0], hook.schedule.version, not hook._reported
            run_step(hook)
            steps.append((version, measured, calls[0] - before))
    finally:
        hook.close()
    assert calls[0] == hook.syncs
    for version, measured, syncs in steps:
        # Measured: the step's two ends and each instruction's; otherwise the clock is the
        # same for every instruction of a version (StepDown) and in force already.
        expected = 2 + 2 * INSTRUCTIONS if measured else 0
        assert syncs == expected, (version, measured, steps)
    assert {v for v, m, _ in steps if not m}  # steps after a report, waiting for a version


def test_idle_watcher_blocks_long_and_stops_at_once(r, redis_url):
    store = JobStore(r)
    job = JobInfo(job_id="idle", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="x"), "1-0")
    client = CoordinatorClient(redis_url)
    watcher = ScheduleWatcher(client, "idle", rank=0, version=0, heartbeat_interval=60)
    watcher.start()
    try:
        # The long read is in flight: the first heartbeat (after a 1 ms read) is done, and a
        # client of Redis's is blocked in a read (Redis counts a blocked command once it ends).
        first_beat = time.monotonic() + 30
        wait_for(
            lambda: (
                watcher._next_beat > first_beat
                and any(c["cmd"] == "xread" and "b" in c["flags"] for c in r.client_list())
            ),
            10,
            "the long blocking read",
        )
        r.config_resetstat()
        time.sleep(1.5)
        # One blocking read every 20 s (twice a second before): none began in 1.5 s.
        assert "cmdstat_xread" not in r.info("commandstats")
    finally:
        start = time.monotonic()
        watcher.stop()
        client.close()
    assert not watcher.is_alive() and time.monotonic() - start < 1.0
    assert watcher.error is None


class _SlowCounterNVML(NVML):
    """The simulated GPU, with an energy counter as slow to read as an H100's (~3 ms)."""

    def total_energy_mj(self, index: int) -> int | None:
        time.sleep(0.003)
        return super().total_energy_mj(index)


class _PreemptedNVML(NVML):
    """The simulated GPU, whose first counter reads are slow: a busy machine preempted them."""

    slow_reads = 3

    def total_energy_mj(self, index: int) -> int | None:
        if self.slow_reads > 0:
            self.slow_reads -= 1
            time.sleep(0.003)
        return super().total_energy_mj(index)


def test_a_counter_read_slowly_only_while_the_machine_was_busy_is_read_on_the_thread(
    tmp_path, monkeypatch
):
    # The simulated counter moves only with simulated work: given a monitor, a rank doing
    # real work failed its first window ("its energy counter has not changed"), in a loaded
    # test run whose first two timed reads were slow.
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path))
    nvml = _PreemptedNVML(SIMULATED_NVML)
    assert isinstance(default_energy_source(nvml, 0), CounterEnergySource)
    assert nvml.slow_reads == 0


def test_a_slow_energy_counter_is_read_off_the_training_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path))
    fast = default_energy_source(NVML(SIMULATED_NVML), 0)
    assert isinstance(fast, CounterEnergySource)  # a cheap read: exact, on the thread
    slow = default_energy_source(_SlowCounterNVML(SIMULATED_NVML), 0)
    try:
        assert isinstance(slow, MonitorEnergySource) and slow.owned
        start = time.perf_counter()
        marks = [slow.mark() for _ in range(100)]
        # Marks are timestamps: 100 of them take less than one counter read.
        assert time.perf_counter() - start < 0.003 and marks == sorted(marks)
        assert slow.monitor.sampler.alive  # the counter is read there
    finally:
        slow.close()
    assert not slow.monitor.sampler.alive
