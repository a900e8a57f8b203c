"""GlobalPowerLimitOptimizer state machine, selectors, HF wrapper, Redis store and CLI.

NVML is the in-process fake (tests/fake_nvml_power.py): no real GPU setting is ever written.
The monitor is a fake whose window results depend on the power limit the fake GPU is at.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from click.testing import CliRunner

from protocol import keys
from protocol.exceptions import ConfigError, CoordinatorUnavailableError, GPUError, ProtocolError
from tests import fake_nvml_power as fake
from worker_client.gpu.energy import Measurement
from worker_client.gpu.nvml import NVML
from worker_client.power_limit.cli import power_limit_group
from worker_client.power_limit.hf import HFGlobalPowerLimitOptimizer
from worker_client.power_limit.optimizer import (
    Done,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitProfile,
    Profiling,
    Ready,
    Time,
    Warmup,
    ZeusCost,
    power_limit_ladder,
    torch_distributed_reducer,
)
from worker_client.power_limit.store import PowerLimitProfileStore

# Power limit (W) -> (time s, energy J) that a profiling window at that limit reports.
RESULTS = {300: (10.0, 1000.0), 250: (10.2, 900.0), 200: (11.0, 850.0), 160: (14.0, 950.0)}


class FakeMonitor:
    def __init__(self, gpu_indices: list[int], results: dict[int, tuple[float, float]]) -> None:
        self.gpu_indices = gpu_indices
        self.nvml = NVML(fake.__name__)
        self.results = results
        self.events: list[tuple[str, str]] = []
        self.open: set[str] = set()

    def begin_window(self, name: str) -> None:
        assert name not in self.open
        self.open.add(name)
        self.events.append(("begin", name))

    def end_window(self, name: str) -> Measurement:
        self.open.remove(name)
        self.events.append(("end", name))
        limit = fake.STATE.gpus[self.gpu_indices[0]].limit_mw // 1000  # what is really set
        t, e = self.results[limit]
        share = e / len(self.gpu_indices)
        return Measurement(time=t, gpu_energy={i: share for i in self.gpu_indices})

    def cancel_window(self, name: str) -> None:
        self.open.remove(name)
        self.events.append(("cancel", name))


@pytest.fixture
def monitor() -> FakeMonitor:
    fake.reset(num_gpus=2, min_limit_mw=160_000, max_limit_mw=300_000)
    return FakeMonitor([0, 1], RESULTS)


def make(monitor: FakeMonitor, **kwargs: Any) -> GlobalPowerLimitOptimizer:
    args: dict[str, Any] = dict(wait_steps=1, warmup_steps=2, profile_steps=3, pl_step=50)
    args.update(kwargs)
    args.setdefault("restore_on_exit", False)
    return GlobalPowerLimitOptimizer(monitor, **args)


def limits_set() -> list[int]:
    """Power limits set on GPU 0 (W), in order; each one also went to GPU 1."""
    on0 = [mw // 1000 for gpu, mw in fake.STATE.set_calls if gpu == 0]
    on1 = [mw // 1000 for gpu, mw in fake.STATE.set_calls if gpu == 1]
    assert on0 == on1
    return on0


def describe(state: object) -> str:
    if isinstance(state, Ready):
        return f"Ready({state.next_power_limit})"
    if isinstance(state, Warmup | Profiling):
        return f"{type(state).__name__}({state.current_power_limit},{state.steps})"
    assert isinstance(state, Done)
    return f"Done({state.optimal_power_limit})"


def test_ladder_clamps_to_min() -> None:
    assert power_limit_ladder(300, 160, 50) == [300, 250, 200, 160]
    assert power_limit_ladder(300, 200, 50) == [300, 250, 200]
    assert power_limit_ladder(300, 300, 25) == [300]
    assert power_limit_ladder(700, 200, 1000) == [700, 200]


def test_full_state_machine(monitor: FakeMonitor, tmp_path: Path) -> None:
    opt = make(monitor, profile_path=tmp_path / "profile.json")
    assert opt.power_limits == [300, 250, 200, 160]
    assert describe(opt.state) == "Ready(300)"
    trace = []
    for _ in range(23):
        opt.on_step_begin()
        opt.on_step_end()
        trace.append(describe(opt.state))
    assert trace == [
        "Ready(300)",  # step 1: waited
        "Warmup(300,1)",  # step 2: 300 W set
        "Warmup(300,2)",
        "Profiling(300,1)",  # step 4: window begins
        "Profiling(300,2)",
        "Profiling(300,3)",
        "Warmup(250,1)",  # step 7: 300 W measured over steps 4-6; 250 W set
        "Warmup(250,2)",
        "Profiling(250,1)",
        "Profiling(250,2)",
        "Profiling(250,3)",
        "Warmup(200,1)",
        "Warmup(200,2)",
        "Profiling(200,1)",
        "Profiling(200,2)",
        "Profiling(200,3)",
        "Warmup(160,1)",  # the minimum, not 150
        "Warmup(160,2)",
        "Profiling(160,1)",
        "Profiling(160,2)",
        "Profiling(160,3)",
        "Done(300)",  # default selector Time: 300 W is the fastest
        "Done(300)",
    ]
    # The GPU starts at its maximum (300 W): setting 300 W first needs no (privileged) write.
    assert limits_set() == [250, 200, 160, 300]
    assert monitor.events == [
        (kind, f"__perseus_power_limit_{pl}") for pl in RESULTS for kind in ("begin", "end")
    ]
    assert [(m.power_limit, m.time, m.energy) for m in opt.measurements] == [
        (pl, t, e) for pl, (t, e) in RESULTS.items()
    ]
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["optimal_power_limit"] == 300
    assert [m["power_limit"] for m in saved["measurements"]] == [300, 250, 200, 160]
    assert saved["selector"] == "Time()"


def test_saved_profile_skips_profiling(monitor: FakeMonitor, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    first = make(monitor, profile_path=path, optimum_selector=Energy())
    for _ in range(22):
        first.on_step_begin()
    assert isinstance(first.state, Done)
    assert first.state.optimal_power_limit == 200
    fake.STATE.set_calls.clear()
    monitor.events.clear()
    # Same profile, another selector: it chooses from the stored measurements at once.
    second = make(monitor, profile_path=path, optimum_selector=MaxSlowdownConstraint(1.5))
    assert describe(second.state) == "Done(160)"
    assert limits_set() == [160]
    for _ in range(30):
        second.on_step_begin()
        second.on_epoch_end()
    assert monitor.events == []
    assert limits_set() == [160]


def test_bad_profile_file(monitor: FakeMonitor, tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"measurements": []}')
    with pytest.raises(ConfigError, match="bad power-limit profile"):
        make(monitor, profile_path=path)


def test_epoch_end_restarts_the_limit(monitor: FakeMonitor) -> None:
    opt = make(monitor)
    for _ in range(8):  # 300 W done; 250 W warm-up step 2
        opt.on_step_begin()
    assert describe(opt.state) == "Warmup(250,2)"
    opt.on_epoch_end()
    assert describe(opt.state) == "Ready(250)"
    opt.on_step_begin()  # no wait_steps again: the limit restarts at once
    assert describe(opt.state) == "Warmup(250,1)"
    opt.on_step_begin()
    opt.on_step_begin()
    opt.on_step_begin()
    assert describe(opt.state) == "Profiling(250,2)"
    opt.on_epoch_end()  # mid-window: the partial window is discarded
    assert describe(opt.state) == "Ready(250)"
    assert monitor.events[-1] == ("cancel", "__perseus_power_limit_250")
    assert not monitor.open
    for _ in range(6):
        opt.on_step_begin()
    assert describe(opt.state) == "Warmup(200,1)"
    assert [m.power_limit for m in opt.measurements] == [300, 250]
    # NVML is written only when the limit changes (the GPU starts at 300 W, and the restarted
    # 250 W limit is still in place).
    assert limits_set() == [250, 200]
    opt.on_epoch_end()
    assert describe(opt.state) == "Ready(200)"


def test_close_restores_max(monitor: FakeMonitor) -> None:
    opt = make(monitor)
    opt.close()
    assert limits_set() == []  # never touched the GPUs: nothing to restore
    opt = make(monitor)
    for _ in range(10):
        opt.on_step_begin()
    assert isinstance(opt.state, Profiling)
    opt.close()
    opt.close()
    assert limits_set() == [250, 300]  # 300 W was already set at the start: no write
    assert not monitor.open  # the open window was cancelled
    assert all(g.limit_mw == 300_000 for g in fake.STATE.gpus)


def test_permission_error_names_the_privilege(monitor: FakeMonitor) -> None:
    fake.STATE.permission_denied = True
    opt = make(monitor)
    for _ in range(5):  # Profiling the maximum, the current limit, needs no privilege.
        opt.on_step_begin()
    assert describe(opt.state).startswith("Profiling(300")
    with pytest.raises(GPUError) as info:
        for _ in range(10):
            opt.on_step_begin()
    message = str(info.value)
    assert "root" in message
    assert "CAP_SYS_ADMIN" in message
    assert "nvmlDeviceSetPowerManagementLimit" in message


def test_argument_errors(monitor: FakeMonitor) -> None:
    for bad in (
        {"warmup_steps": 0},
        {"profile_steps": 0},
        {"pl_step": 0},
        {"wait_steps": -1},
        {"profile_store": object()},
    ):
        with pytest.raises(ConfigError):
            make(monitor, **bad)
    for eta in (-0.1, 1.1):
        with pytest.raises(ValueError, match="eta"):
            ZeusCost(eta)
    with pytest.raises(ValueError, match=r"at least 1\.0"):
        MaxSlowdownConstraint(0.9)
    with pytest.raises(ValueError, match="world_size"):
        ZeusCost(0.5, world_size=0)


MEASUREMENTS = [
    PowerLimitMeasurement(power_limit=pl, time=t, energy=e) for pl, (t, e) in RESULTS.items()
]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (Energy(), 200),
        (Time(), 300),
        (ZeusCost(1.0), 200),  # pure energy
        (ZeusCost(0.0), 300),  # pure time
        (ZeusCost(0.5), 250),  # 0.5*900 + 0.5*300*10.2 = 1980 is the least
        (ZeusCost(0.5, world_size=2), 300),  # time counts double: 3500 < 3510
        (MaxSlowdownConstraint(1.0), 300),
        (MaxSlowdownConstraint(1.1), 200),  # times up to 11.0 s allowed
        (MaxSlowdownConstraint(1.5), 160),
    ],
)
def test_selectors(selector: Any, expected: int) -> None:
    assert selector.select(MEASUREMENTS) == expected


def test_time_ties_go_to_the_lower_limit() -> None:
    tied = [
        PowerLimitMeasurement(power_limit=300, time=10.0, energy=5.0),
        PowerLimitMeasurement(power_limit=275, time=10.0, energy=4.0),
    ]
    assert Time().select(tied) == 275
    with pytest.raises(ValueError, match="no power limit measurements"):
        Energy().select([])


def test_reducer_is_pluggable(monitor: FakeMonitor) -> None:
    calls = []

    def reducer(t: float, e: float) -> tuple[float, float]:
        calls.append((t, e))
        return t + 1.0, e * 4

    opt = make(monitor, reducer=reducer, optimum_selector=Energy())
    for _ in range(22):
        opt.on_step_begin()
    assert calls == list(RESULTS.values())
    assert opt.measurements[0].time == 11.0
    assert opt.measurements[0].energy == 4000.0


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


def test_hf_wrapper_forwards_events(monitor: FakeMonitor) -> None:
    cb = HFGlobalPowerLimitOptimizer(
        monitor, wait_steps=0, warmup_steps=1, profile_steps=1, pl_step=50, restore_on_exit=False
    )
    assert isinstance(cb.optimizer, GlobalPowerLimitOptimizer)
    cb.on_step_begin(None, None, None)
    assert describe(cb.optimizer.state) == "Warmup(300,1)"
    cb.on_epoch_end(None, None, None, model=None, logs={})
    assert describe(cb.optimizer.state) == "Ready(300)"
    cb.on_train_end(None, None, None)
    assert all(g.limit_mw == 300_000 for g in fake.STATE.gpus)

    recorder = Recorder()
    cb.optimizer = recorder  # type: ignore[assignment]
    cb.on_step_begin("args", "state", "control", model="m", extra=1)
    cb.on_step_end("args", "state", "control")
    cb.on_epoch_end("args", "state", "control")
    assert recorder.calls == ["on_step_begin", "on_step_end", "on_epoch_end"]


# --- Redis store --------------------------------------------------------------------------------
def profile(optimal: int = 250) -> PowerLimitProfile:
    return PowerLimitProfile(measurements=MEASUREMENTS, optimal_power_limit=optimal, selector="x")


def test_store_round_trip(r: redis.Redis) -> None:
    store = PowerLimitProfileStore(r)
    assert store.load("bert") is None
    store.save("bert", profile())
    loaded = store.load("bert")
    assert loaded is not None
    assert loaded.measurements == MEASUREMENTS
    assert loaded.optimal_power_limit == 250
    assert loaded.updated_at > 0
    assert r.type(keys.power_limit_profile("bert")) == b"string"
    assert msgpack.unpackb(r.get(keys.power_limit_profile("bert")))["optimal_power_limit"] == 250
    assert r.zscore(keys.POWER_LIMIT_INDEX, "bert") == pytest.approx(loaded.updated_at)

    pipe = r.pipeline(transaction=True)
    store.save("gpt", profile(300), pipeline=pipe)
    assert store.load("gpt") is None  # queued, not run
    pipe.execute()
    summaries = store.list_profiles()
    assert [(s.workload, s.optimal_power_limit, s.num_measurements) for s in summaries] == [
        ("bert", 250, 4),
        ("gpt", 300, 4),
    ]
    assert store.delete("bert") is True
    assert store.delete("bert") is False
    assert store.load("bert") is None
    assert r.zrange(keys.POWER_LIMIT_INDEX, 0, -1) == [b"gpt"]


def test_store_errors(r: redis.Redis) -> None:
    store = PowerLimitProfileStore(r)
    for bad in ("a:b", "", "with space"):
        with pytest.raises(ConfigError, match="workload name"):
            store.save(bad, profile())
    r.set(keys.power_limit_profile("junk"), b"\x00not msgpack")
    r.zadd(keys.POWER_LIMIT_INDEX, {"junk": 1.0})
    with pytest.raises(ProtocolError, match="junk"):
        store.load("junk")
    assert [(s.workload, s.optimal_power_limit) for s in store.list_profiles()] == [("junk", None)]
    down = PowerLimitProfileStore.from_url("redis://127.0.0.1:1/0", timeout=0.5)
    with pytest.raises(CoordinatorUnavailableError):
        down.load("bert")
    with pytest.raises(CoordinatorUnavailableError):
        down.save("bert", profile())


def test_optimizer_with_redis_store(monitor: FakeMonitor, r: redis.Redis) -> None:
    store = PowerLimitProfileStore(r)
    first = make(monitor, profile_store=store, workload="bert", optimum_selector=Energy())
    for _ in range(22):
        first.on_step_begin()
    stored = store.load("bert")
    assert stored is not None
    assert stored.optimal_power_limit == 200
    assert [m.power_limit for m in stored.measurements] == [300, 250, 200, 160]

    fake.STATE.set_calls.clear()
    for gpu in fake.STATE.gpus:  # a fresh run starts at the maximum limit again
        gpu.limit_mw = 300_000
    second = make(monitor, profile_store=store, workload="bert", optimum_selector=Energy())
    assert describe(second.state) == "Done(200)"
    assert limits_set() == [200]

    # Redis unreachable: the optimizer profiles instead of failing the training job.
    down = PowerLimitProfileStore.from_url("redis://127.0.0.1:1/0", timeout=0.5)
    third = make(monitor, profile_store=down, workload="bert")
    assert describe(third.state) == "Ready(300)"


def test_cli_show_and_delete(r: redis.Redis, redis_url: str) -> None:
    store = PowerLimitProfileStore(r)
    runner = CliRunner()
    result = runner.invoke(power_limit_group, ["show", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert "no power-limit profiles stored" in result.output

    store.save("bert", profile(250))
    store.save("gpt", profile(300))
    result = runner.invoke(power_limit_group, ["show"], env={"PERSEUS_REDIS_URL": redis_url})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["workload", "limit", "(W)", "measurements", "updated"]
    assert lines[2].split()[:3] == ["bert", "250", "4"]
    assert lines[3].split()[:3] == ["gpt", "300", "4"]

    result = runner.invoke(power_limit_group, ["show", "bert", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert "optimal 250 W" in result.output
    rows = [line.split() for line in result.output.splitlines()[3:]]
    assert rows[1][:4] == ["*", "250", "10.200", "900.0"]
    assert rows[0][:3] == ["300", "10.000", "1000.0"]

    result = runner.invoke(power_limit_group, ["show", "bert", "--json", "--redis-url", redis_url])
    assert json.loads(result.output)["optimal_power_limit"] == 250

    result = runner.invoke(power_limit_group, ["show", "nope", "--redis-url", redis_url])
    assert result.exit_code == 1
    assert "no power-limit profile stored for 'nope'" in result.output

    result = runner.invoke(power_limit_group, ["delete", "bert", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert store.load("bert") is None
    result = runner.invoke(power_limit_group, ["delete", "bert", "--redis-url", redis_url])
    assert result.exit_code == 1

    result = runner.invoke(power_limit_group, ["show", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1
    assert "Redis" in result.output


def test_max_restored_at_interpreter_exit() -> None:
    script = """
import atexit
from tests import fake_nvml_power as fake
from tests.test_power_limit import RESULTS, FakeMonitor
from worker_client.power_limit.optimizer import GlobalPowerLimitOptimizer
fake.reset(num_gpus=1, min_limit_mw=160_000, max_limit_mw=300_000)
atexit.register(lambda: print("limits", [mw for _, mw in fake.STATE.set_calls]))  # runs last
opt = GlobalPowerLimitOptimizer(FakeMonitor([0], RESULTS), wait_steps=0, warmup_steps=1,
                                profile_steps=1, pl_step=50)
for _ in range(3):
    opt.on_step_begin()
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "limits [250000, 300000]"
