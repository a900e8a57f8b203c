"""GlobalPowerLimitOptimizer state machine, HF wrapper and the optimizer on a Redis store.

NVML is the in-process fake (tests/fake_nvml_power.py): no real GPU setting is ever written.
Steps run on its virtual clock, at the power limit the fake GPUs are at (ReplayTraining).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol import keys
from protocol.exceptions import ConfigError, GPUError
from tests import fake_nvml_power as fake
from tests.fake_nvml_power import (
    ReplayMonitor,
    ReplayTraining,
    limits_now,
    limits_set,
    run_steps,
)
from tests.fake_nvml_power import describe_state as describe
from worker_client.gpu.nvml import NVML
from worker_client.power_limit.hf import HFGlobalPowerLimitOptimizer
from worker_client.power_limit.optimizer import (
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    Profiling,
    Time,
    ZeusCost,
    power_limit_ladder,
    torch_distributed_reducer,
)
from worker_client.power_limit.store import PowerLimitProfileStore

# Power limit (W) -> (step time s, power per GPU W) of the fake GPUs (160-300 W).
TABLE = {300: (0.100, 280.0), 250: (0.104, 245.0), 200: (0.115, 198.0), 160: (0.140, 158.0)}
LADDER = [300, 250, 200]  # range(300, 160 - 1, -50) W
PROFILE = 3


@pytest.fixture
def training() -> ReplayTraining:
    fake.reset(num_gpus=2, min_limit_mw=160_000, max_limit_mw=300_000)
    return ReplayTraining(TABLE, [0, 1])


def make(training: ReplayTraining, **kwargs: Any) -> GlobalPowerLimitOptimizer:
    args: dict[str, Any] = dict(wait_steps=1, warmup_steps=2, profile_steps=PROFILE, pl_step=50)
    args.update(kwargs)
    args.setdefault("restore_on_exit", False)
    return GlobalPowerLimitOptimizer(ReplayMonitor(training), **args)


def window(pl: int) -> str:
    return f"__perseus_power_limit_{pl}"


def expected(pl: int) -> tuple[float, float]:
    """(time, energy) of a PROFILE-step window at ``pl`` W on the two fake GPUs."""
    seconds, watts = TABLE[pl]
    return PROFILE * seconds, 2 * PROFILE * seconds * watts


def test_ladder_is_zeus_range() -> None:
    assert power_limit_ladder(300_000, 160_000, 50) == [300_000, 250_000, 200_000]
    assert power_limit_ladder(300_000, 200_000, 50) == [300_000, 250_000, 200_000]
    assert power_limit_ladder(300_000, 300_000, 25) == [300_000]
    assert power_limit_ladder(700_000, 200_000, 1000) == [700_000]


def test_full_state_machine(training: ReplayTraining, tmp_path: Path) -> None:
    opt = make(training, profile_path=tmp_path / "profile.json")
    assert opt.power_limits == [pl * 1000 for pl in LADDER]
    assert describe(opt.state) == "Ready(300,2)"  # wait_steps=1: the second step begin sets it
    trace = []
    for _ in range(18):
        opt.on_step_begin()
        training.step()
        opt.on_step_end()
        trace.append(describe(opt.state))
    assert trace == [
        "Ready(300,1)",  # step 1: waited
        "Warmup(300,2)",  # step 2: 300 W (already set at construction)
        "Warmup(300,1)",
        "Profiling(300,3)",  # step 4: window begins
        "Profiling(300,2)",
        "Profiling(300,1)",
        "Warmup(250,2)",  # step 7: 300 W measured over steps 4-6; 250 W set
        "Warmup(250,1)",
        "Profiling(250,3)",
        "Profiling(250,2)",
        "Profiling(250,1)",
        "Warmup(200,2)",
        "Warmup(200,1)",
        "Profiling(200,3)",
        "Profiling(200,2)",
        "Profiling(200,1)",
        "Done(250)",  # default ZeusCost(0.5, world_size=2)
        "Done(250)",
    ]
    assert training.step_limits == [300] * 6 + [250] * 5 + [200] * 5 + [250] * 2
    assert limits_set() == [250, 200, 250]  # the GPUs started at 300 W: no write needed
    assert training.gpu_indices and limits_set(1) == limits_set(0)
    monitor = opt.monitor
    assert isinstance(monitor, ReplayMonitor)
    assert monitor.events == [(kind, window(pl)) for pl in LADDER for kind in ("begin", "end")]
    assert [m.power_limit for m in opt.measurements] == LADDER
    for m in opt.measurements:
        assert (m.time, m.energy) == pytest.approx(expected(m.power_limit))
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["optimal_power_limit"] == 250
    assert [m["power_limit"] for m in saved["measurements"]] == LADDER
    assert saved["selector"] == "ZeusCost(eta_knob=0.5, world_size=2)"


def test_saved_profile_skips_profiling(training: ReplayTraining, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    first = make(training, profile_path=path, optimum_selector=Energy())
    run_steps(first, training, 17)
    assert describe(first.state) == "Done(200)"
    fake.STATE.set_calls.clear()
    # Same profile, another selector: it chooses from the stored measurements at once.
    second = make(training, profile_path=path, optimum_selector=MaxSlowdownConstraint(1.1))
    assert describe(second.state) == "Done(250)"
    assert limits_set() == [250]
    monitor = second.monitor
    assert isinstance(monitor, ReplayMonitor)
    run_steps(second, training, 30, epoch_steps=7)
    assert monitor.events == []
    assert limits_set() == [250]


def test_bad_profile_files(training: ReplayTraining, tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    for text, expect in (
        ('{"measurements": []}', "measurements: List should have at least 1 item"),
        ('{"measurements": [\n  {"power_limit": 300, "energy": 1.0}\n', "line 3"),
        ('{"measurements": [{"power_limit": 300, "energy": 1, "time": -2}]}', r"\[0\]\.time"),
        ('{"measurements": [{"power_limit": 300, "energy": 1}]}', r"\[0\]\.time: Field required"),
        ("[1, 2]", "expected an object with 'measurements'"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=expect) as info:
            make(training, profile_path=path)
        assert str(path) in str(info.value)


def test_arguments_that_would_fail_only_after_profiling_are_refused_at_once(
    training: ReplayTraining, tmp_path: Path
) -> None:
    for selector in (Energy, "Energy", object()):
        with pytest.raises(ConfigError, match="optimum_selector must be a selector"):
            make(training, optimum_selector=selector)
    missing = tmp_path / "no-such-folder" / "profile.json"
    with pytest.raises(ConfigError, match=r"no-such-folder.* does not exist"):
        make(training, profile_path=missing)
    for name in ("wait_steps", "profile_steps"):
        with pytest.raises(ConfigError, match=f"{name} must be an integer >= "):
            make(training, **{name: True})
    # What is refused above is what works: a selector object, a new file in an existing folder.
    opt = make(training, optimum_selector=Energy(), profile_path=tmp_path / "new.json")
    run_steps(opt, training, 17)
    assert describe(opt.state) == "Done(200)" and (tmp_path / "new.json").exists()


@pytest.mark.parametrize(
    ("carry", "epoch_steps", "stalls"),
    [(False, 2 + PROFILE, True), (False, 3 + PROFILE, False), (True, 1, True), (True, 2, False)],
)
def test_epochs_too_short_to_advance_are_reported_once(
    training: ReplayTraining,
    caplog: pytest.LogCaptureFixture,
    carry: bool,
    epoch_steps: int,
    stalls: bool,
) -> None:
    opt = make(training, carry_across_epochs=carry)  # 2 warm-up + PROFILE measured steps
    run_steps(opt, training, 40 * epoch_steps, epoch_steps=epoch_steps)
    warnings = [r.getMessage() for r in caplog.records if "not advancing" in r.getMessage()]
    if not stalls:
        assert warnings == [] and describe(opt.state).startswith("Done")
        return
    need = "2 steps or more" if carry else f"over {2 + PROFILE} steps, or pass carry_across"
    assert len(warnings) == 1 and "left 300 W where it was" in warnings[0], warnings
    assert need in warnings[0]


def test_epoch_end_restarts_the_limit(training: ReplayTraining) -> None:
    opt = make(training)
    run_steps(opt, training, 8)  # 300 W done; 250 W warm-up step 2
    assert describe(opt.state) == "Warmup(250,1)"
    opt.on_epoch_end()
    assert describe(opt.state) == "Ready(250,1)"
    assert limits_now() == [300, 300]
    run_steps(opt, training, 1)  # no wait_steps again: the limit restarts at once
    assert describe(opt.state) == "Warmup(250,2)"
    run_steps(opt, training, 3)
    assert describe(opt.state) == "Profiling(250,2)"
    opt.on_epoch_end()  # mid-window: the partial window is discarded
    assert describe(opt.state) == "Ready(250,1)"
    monitor = opt.monitor
    assert isinstance(monitor, ReplayMonitor)
    assert monitor.events[-1] == ("cancel", window(250))
    assert not monitor.open
    run_steps(opt, training, 6)
    assert describe(opt.state) == "Warmup(200,2)"
    assert [m.power_limit for m in opt.measurements] == [300, 250]
    assert (opt.measurements[1].time, opt.measurements[1].energy) == pytest.approx(expected(250))
    assert limits_set() == [250, 300, 250, 300, 250, 200]
    opt.on_epoch_end()
    assert describe(opt.state) == "Ready(200,1)"
    opt.on_epoch_end()  # nothing to interrupt: nothing happens
    assert describe(opt.state) == "Ready(200,1)"


def test_close_restores_max(training: ReplayTraining) -> None:
    opt = make(training)
    opt.close()
    assert limits_set() == []  # the GPUs are at the maximum already: no write
    opt = make(training)
    run_steps(opt, training, 10)
    assert isinstance(opt.state, Profiling)
    opt.close()
    opt.close()
    assert limits_set() == [250, 300]
    monitor = opt.monitor
    assert isinstance(monitor, ReplayMonitor)
    assert not monitor.open  # the open window was cancelled
    assert limits_now() == [300, 300]
    assert describe(opt.state) == "Ready(250,1)"


def test_permission_error_names_the_privilege(training: ReplayTraining) -> None:
    fake.STATE.permission_denied = True
    opt = make(training)  # the GPUs are at the maximum: no privilege needed yet
    run_steps(opt, training, 5)  # profiling the maximum needs none either
    assert describe(opt.state).startswith("Profiling(300")
    with pytest.raises(GPUError) as info:
        run_steps(opt, training, 10)
    message = str(info.value)
    assert "root" in message
    assert "CAP_SYS_ADMIN" in message
    assert "nvmlDeviceSetPowerManagementLimit" in message


def test_argument_errors(training: ReplayTraining) -> None:
    for bad in (
        {"warmup_steps": 0},
        {"profile_steps": 0},
        {"pl_step": 0},
        {"wait_steps": -1},
        {"profile_store": object()},
    ):
        with pytest.raises(ConfigError):
            make(training, **bad)
    for eta in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError, match="eta"):
            ZeusCost(eta)
    for factor in (0.9, float("nan")):
        with pytest.raises(ValueError, match=r"at least 1\.0"):
            MaxSlowdownConstraint(factor)
    with pytest.raises(ValueError, match="world_size"):
        ZeusCost(0.5, world_size=0)


def test_reducer_is_pluggable(training: ReplayTraining) -> None:
    calls = []

    def reducer(t: float, e: float) -> tuple[float, float]:
        calls.append((t, e))
        if len(calls) <= 2:  # construction's: the ladder's mark (max, min) agrees
            return t, e * 4
        return t + 1.0, e * 4

    opt = make(training, reducer=reducer, optimum_selector=Energy())
    run_steps(opt, training, 17)
    # First the ladder's mark (max, then min as max of its negative) and whether any rank
    # lacks a profile (this one does: energy 1, summed), then each limit, then the GPUs as
    # the limit is chosen (every rank reduces then, whatever its selector), then the ranks
    # that could not set it (none: 0, summed) with the highest optimum (max), then the
    # lowest (max of its negative).
    assert calls[0][0] == -calls[1][0] > 0 and (calls[0][1], calls[1][1]) == (0.0, 1.0)
    assert len(calls) == 2 + len(LADDER) + 3
    optimum = float(opt.state.optimal_power_limit)  # type: ignore[union-attr]
    assert calls[-3:] == [(0.0, len(opt.gpu_indices)), (optimum, 0.0), (-optimum, 0.0)]
    for call, pl in zip(calls[2:-3], LADDER, strict=True):
        assert call == pytest.approx(expected(pl))
    assert opt.measurements[0].time == pytest.approx(expected(300)[0] + 1.0)
    assert opt.measurements[0].energy == pytest.approx(expected(300)[1] * 4)


def test_torch_distributed_reducer(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    assert torch_distributed_reducer(2.0, 5.0) == (2.0, 5.0)  # not initialized: unchanged
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert torch_distributed_reducer(2.0, 5.0) == (2.0, 5.0)  # one rank: max/sum of itself
    finally:
        dist.destroy_process_group()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda: self.calls.append(name)


def test_hf_wrapper_forwards_events(training: ReplayTraining) -> None:
    cb = HFGlobalPowerLimitOptimizer(
        ReplayMonitor(training),
        wait_steps=0,
        warmup_steps=1,
        profile_steps=1,
        pl_step=50,
        restore_on_exit=False,
        carry_across_epochs=True,
    )
    assert isinstance(cb.optimizer, GlobalPowerLimitOptimizer)
    assert cb.optimizer.carry_across_epochs
    cb.on_step_begin(None, None, None)
    assert describe(cb.optimizer.state) == "Warmup(300,1)"
    cb.on_epoch_end(None, None, None, model=None, logs={})
    assert describe(cb.optimizer.state) == "Paused(300,1,0)"
    cb.on_train_end(None, None, None)
    assert limits_now() == [300, 300]

    recorder = Recorder()
    cb.optimizer = recorder  # type: ignore[assignment]
    cb.on_step_begin("args", "state", "control", model="m", extra=1)
    cb.on_step_end("args", "state", "control")
    cb.on_epoch_end("args", "state", "control")
    cb.on_train_end("args", "state", "control")
    assert recorder.calls == ["on_step_begin", "on_step_end", "on_epoch_end", "close"]
    with pytest.raises(TypeError, match="profile_setps"):
        HFGlobalPowerLimitOptimizer(ReplayMonitor(training), profile_setps=3)  # type: ignore[call-arg]


def test_optimizer_with_redis_store(training: ReplayTraining, r: redis.Redis) -> None:
    store = PowerLimitProfileStore(r)
    first = make(training, profile_store=store, workload="bert", optimum_selector=Energy())
    run_steps(first, training, 17)
    stored = store.load("bert")
    assert stored is not None
    assert stored.optimal_power_limit == 200
    assert [m.power_limit for m in stored.measurements] == LADDER

    fake.STATE.set_calls.clear()
    for gpu in fake.STATE.gpus:  # a fresh run starts at the maximum limit again
        gpu.limit_mw = 300_000
    second = make(training, profile_store=store, workload="bert", optimum_selector=Energy())
    assert describe(second.state) == "Done(200)"
    assert limits_set() == [200]

    # Redis unreachable: the optimizer profiles instead of failing the training job.
    down = PowerLimitProfileStore.from_url("redis://127.0.0.1:1/0", timeout=0.5)
    third = make(training, profile_store=down, workload="bert")
    assert describe(third.state) == "Ready(300,2)"


def test_a_profile_from_redis_is_still_saved_to_a_missing_profile_path(
    training: ReplayTraining, r: redis.Redis, tmp_path: Path
) -> None:
    # Zeus: a profile_path that does not exist gets the profile once it is known. Redis
    # having the profile skips the profiling, not the file.
    store = PowerLimitProfileStore(r)
    first = make(training, profile_store=store, workload="bert", optimum_selector=Energy())
    run_steps(first, training, 17)
    stored = store.load("bert")
    assert stored is not None

    path = tmp_path / "profile.json"
    second = make(
        training, profile_store=store, workload="bert", optimum_selector=Time(), profile_path=path
    )
    assert describe(second.state) == "Done(300)"
    written = json.loads(path.read_text())
    assert written["measurements"] == [m.model_dump() for m in stored.measurements]
    assert written["optimal_power_limit"] == 300  # this run's selector's choice
    assert written["selector"] == "Time()"
    assert written["updated_at"] == stored.updated_at  # when it was measured
    after = store.load("bert")  # the store keeps what it had
    assert after is not None and after.optimal_power_limit == 200


def test_an_unreadable_stored_profile_is_profiled_again_and_replaced(
    training: ReplayTraining, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = PowerLimitProfileStore(r)
    r.set(keys.power_limit_profile("bert"), b"\xc1 not msgpack")
    with caplog.at_level(logging.WARNING, logger="worker_client.power_limit"):
        optimizer = make(training, profile_store=store, workload="bert", optimum_selector=Energy())
    assert describe(optimizer.state) == "Ready(300,2)"
    assert "bad stored power-limit profile of 'bert'" in caplog.text
    assert "profiling again" in caplog.text
    run_steps(optimizer, training, 17)
    stored = store.load("bert")
    assert stored is not None and stored.optimal_power_limit == 200


class ZeusLikeMonitor:
    """A monitor shaped like Zeus's ZeusMonitor: CUDA indices, ``end_window(cancel=True)``."""

    def __init__(self, training: ReplayTraining, cuda_to_nvml: dict[int, int]) -> None:
        self.training, self.nvml_of = training, cuda_to_nvml
        self.gpu_indices = list(cuda_to_nvml)
        self.open: dict[str, tuple[float, dict[int, float]]] = {}
        self.cancelled: list[str] = []

    def begin_window(self, name: str) -> None:
        self.open[name] = (self.training.now, dict(self.training.energy))

    def end_window(self, name: str, sync_execution: bool = True, cancel: bool = False) -> Any:
        t0, e0 = self.open.pop(name)
        if cancel:
            self.cancelled.append(name)
        energy = {c: self.training.energy[n] - e0[n] for c, n in self.nvml_of.items()}
        return fake.WindowResult(time=self.training.now - t0, gpu_energy=energy)


def test_a_zeus_monitor_under_cuda_visible_devices_limits_the_gpus_it_names(monkeypatch):
    # CUDA devices 0 and 1 are NVML's GPUs 2 and 3: only those get a power limit, and a
    # window an epoch end interrupts is cancelled the way Zeus's monitor takes it.
    fake.reset(num_gpus=4, min_limit_mw=160_000, max_limit_mw=300_000)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    training = ReplayTraining(TABLE, [2, 3])
    monitor = ZeusLikeMonitor(training, {0: 2, 1: 3})
    opt = GlobalPowerLimitOptimizer(
        monitor,
        nvml=NVML(fake.__name__),
        wait_steps=1,
        warmup_steps=2,
        profile_steps=PROFILE,
        pl_step=50,
        restore_on_exit=False,
    )
    run_steps(opt, training, 10)
    assert describe(opt.state) == "Profiling(250,2)"
    opt.on_epoch_end()
    assert monitor.cancelled == [window(250)] and not monitor.open
    assert limits_set(2) == limits_set(3) == [250, 300]
    assert limits_set(0) == limits_set(1) == []
