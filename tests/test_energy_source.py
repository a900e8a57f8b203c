"""Energy sources (counter, monitor, null) and the hook's per-instruction energy reports."""

from __future__ import annotations

import time

import pytest

from protocol.exceptions import ConfigError
from protocol.store import JobStore
from tests import fake_nvml_power as fake
from tests.rank_helpers import make_hook
from worker_client.gpu.energy import EnergyMonitor
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.gpu.nvml import NVML, SIMULATED_NVML
from worker_client.hook.energy_source import (
    CounterEnergySource,
    EnergySource,
    MonitorEnergySource,
    NullEnergySource,
)
from worker_client.simulated.gpu import SimulatedGPU, synthetic_instruction_table


def test_counter_source_reads_the_simulated_counter(sim_dir):
    table = synthetic_instruction_table(1)
    gpu = SimulatedGPU(1, table=table)
    source = CounterEnergySource(NVML(SIMULATED_NVML), 1)
    assert isinstance(source, EnergySource)
    a = source.mark()
    gpu.run(0, "backward", time_scale=0)
    b = source.mark()
    assert source.energy(a, b) == pytest.approx(table[(0, "backward", 1980)][1], abs=1e-3)
    assert source.energy(b, a) == 0.0  # A counter that went back (driver reload) reads 0 J.


def test_counter_source_without_a_counter_reads_zero():
    fake.reset(counter_supported=False)
    source = CounterEnergySource(NVML(fake.__name__), 0)
    assert source.mark() == 0.0 and source.energy(source.mark(), source.mark()) == 0.0


def test_null_source():
    source = NullEnergySource()
    assert isinstance(source, EnergySource)
    assert source.energy(source.mark(), source.mark()) == 0.0


def test_monitor_source_interpolates_between_timestamps():
    fake.reset(watts=250.0, update_period=0.1)
    monitor = EnergyMonitor(nvml=NVML(fake.__name__), sample_interval=0.01)
    try:
        with pytest.raises(ConfigError, match="not GPU 3"):
            MonitorEnergySource(monitor, 3)
        source = MonitorEnergySource(monitor, 0)
        a = source.mark()
        time.sleep(0.3)
        b = source.mark()
        truth = fake.STATE.gpus[0].energy_between(a, b)
        measured = monitor.measure_between(a, b)
        assert source.energy(a, b) == pytest.approx(measured.gpu_energy[0])
        assert abs(measured.gpu_energy[0] - truth) <= measured.gpu_energy_error_bound[0] + 0.005
        assert source.energy(a, b) == pytest.approx(75.0, rel=0.1)
        with pytest.raises(ValueError, match="not monitored"):
            monitor.energy_between(1, a, b)
    finally:
        monitor.close()


def test_hook_reports_instruction_energy(gloo, hook_service, redis_url, r, sim_dir):
    _coord, start_worker = hook_service
    start_worker()
    table = synthetic_instruction_table(1)
    gpu = SimulatedGPU(0, table=table)
    virtual = [0.0]  # A simulated clock: instruction times are exactly the table's.
    hook = make_hook(
        redis_url,
        DryRunFrequencyController(0),
        report_every=2,
        instruction_energy=True,
        clock=lambda: virtual[0],
    )
    try:
        for _ in range(3):
            hook.on_step_begin()
            for name in ("forward", "backward") * 2:
                hook.on_instruction_begin(name)
                t, _e = gpu.run(0, name, time_scale=0)
                virtual[0] += t
                hook.on_instruction_end(name)
            hook.on_step_end()
    finally:
        hook.close()  # Flushes the queued result.
    deadline = time.monotonic() + 10
    store = JobStore(r)
    while not store.results(hook.job_id, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    (result,) = store.results(hook.job_id, 1)
    (t_f, e_f), (t_b, e_b) = table[(0, "forward", 1980)], table[(0, "backward", 1980)]
    assert set(result.time_breakdown) == set(result.energy_breakdown) == {"forward", "backward"}
    for name, t, e in (("forward", t_f, e_f), ("backward", t_b, e_b)):
        assert [len(it) for it in result.time_breakdown[name]] == [2, 2]
        assert [len(it) for it in result.energy_breakdown[name]] == [2, 2]
        for times, energies in zip(
            result.time_breakdown[name], result.energy_breakdown[name], strict=True
        ):
            assert times == pytest.approx([t, t])
            assert energies == pytest.approx([e, e], abs=2e-3)
    assert result.iter_time == pytest.approx([2 * (t_f + t_b)] * 2)
    assert result.iter_energy == pytest.approx([2 * (e_f + e_b)] * 2, abs=2e-3)
