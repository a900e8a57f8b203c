"""GlobalPowerLimitOptimizer against Zeus's GlobalPowerLimitOptimizer, one test per disagreement.

Issue 15 lists eleven places where perseus-mq chose differently from Zeus (zeus 0.16); each
test below pins Zeus's behaviour. The GPUs are the in-process fake NVML
(tests/fake_nvml_power.py) and steps run on its virtual clock: no real GPU is touched. Point
8's tests that run two ranks as processes are in tests/test_power_limit_zeus_ranks.py.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, PositiveFloat, PositiveInt

from protocol.exceptions import ConfigError
from protocol.models import PowerLimitMeasurement
from tests import fake_nvml_power as fake
from tests.fake_nvml_power import ReplayMonitor, ReplayTraining, limits_now, limits_set, run_steps
from worker_client.power_limit.hf import HFGlobalPowerLimitOptimizer
from worker_client.power_limit.optimizer import GlobalPowerLimitOptimizer
from worker_client.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
)
from worker_client.power_limit.states import Done, Profiling, Ready, Warmup

# Power limit (W) -> (step time s, power per GPU W); 160 W is the GPUs' minimum.
TABLE = {
    300: (0.100, 280.0),
    250: (0.104, 245.0),
    200: (0.115, 198.0),
    160: (0.140, 158.0),
}
WARMUP, PROFILE = 2, 3


@pytest.fixture
def training() -> ReplayTraining:
    fake.reset(num_gpus=2, min_limit_mw=160_000, max_limit_mw=300_000)
    return ReplayTraining(TABLE, [0, 1])


def make(training: ReplayTraining, **kwargs: Any) -> GlobalPowerLimitOptimizer:
    args: dict[str, Any] = dict(
        wait_steps=1, warmup_steps=WARMUP, profile_steps=PROFILE, pl_step=50
    )
    args.update(kwargs)
    args.setdefault("restore_on_exit", False)
    return GlobalPowerLimitOptimizer(ReplayMonitor(training), **args)


def profiled(opt: GlobalPowerLimitOptimizer) -> list[int]:
    return [m.power_limit for m in opt.measurements]


def m(power_limit: int, time: float, energy: float) -> PowerLimitMeasurement:
    return PowerLimitMeasurement(power_limit=power_limit, time=time, energy=energy)


# 1 ---------------------------------------------------------------------------------------------
def test_epoch_end_while_profiling_resets_the_maximum(training: ReplayTraining) -> None:
    opt = make(training)
    run_steps(opt, training, 1 + WARMUP + PROFILE + 1)  # 300 W measured, 250 W warming up
    assert limits_now() == [250, 250]
    opt.on_epoch_end()
    assert limits_now() == [300, 300]  # evaluation and checkpointing run at full power
    run_steps(opt, training, 1)
    assert limits_now() == [250, 250]  # the interrupted limit starts over


# 2 ---------------------------------------------------------------------------------------------
def test_construction_sets_the_maximum(training: ReplayTraining) -> None:
    for gpu in fake.STATE.gpus:  # left low by a job that crashed
        gpu.limit_mw = 200_000
    opt = make(training, wait_steps=3)
    assert limits_now() == [300, 300]
    run_steps(opt, training, 3)  # the wait steps run at the maximum
    assert training.step_limits == [300, 300, 300]


# 3 ---------------------------------------------------------------------------------------------
def test_ladder_is_zeus_range_without_the_minimum(training: ReplayTraining) -> None:
    opt = make(training)
    run_steps(opt, training, 40)
    assert profiled(opt) == [300, 250, 200]  # range(300, 160 - 1, -50): no 160 W
    assert 160 not in training.step_limits


# 4 ---------------------------------------------------------------------------------------------
def test_default_selector_is_zeus_cost_half(training: ReplayTraining) -> None:
    opt = make(training)
    assert isinstance(opt.optimum_selector, ZeusCost)
    assert (opt.optimum_selector.eta_knob, opt.optimum_selector.world_size) == (0.5, 2)
    run_steps(opt, training, 40)
    # Time would keep 300 W; the Zeus cost with eta 0.5 over 2 GPUs picks 250 W.
    by_cost = {x.power_limit: 0.5 * x.energy + 0.5 * (300 * 2) * x.time for x in opt.measurements}
    assert min(by_cost, key=by_cost.__getitem__) == 250
    assert limits_now() == [250, 250]


# 5 ---------------------------------------------------------------------------------------------
def test_max_slowdown_is_measured_against_the_maximum_limit() -> None:
    # The fastest time (250 W) is not the maximum limit's: Zeus allows 10% over 300 W's 10.0 s.
    noisy = [m(300, 10.0, 1000.0), m(250, 9.5, 900.0), m(200, 10.8, 850.0), m(150, 12.0, 800.0)]
    assert MaxSlowdownConstraint(1.1).select(noisy) == 200
    assert MaxSlowdownConstraint(1.0).select(noisy) == 250
    # The maximum limit is found by value, wherever it is in the list.
    assert MaxSlowdownConstraint(1.1).select(list(reversed(noisy))) == 200


# 6 ---------------------------------------------------------------------------------------------
def test_exact_ties_keep_the_first_profiled_limit() -> None:
    tied = [m(300, 10.0, 900.0), m(250, 10.0, 900.0), m(200, 11.0, 950.0)]
    assert Time().select(tied) == 300
    assert Energy().select(tied) == 300
    assert ZeusCost(0.5).select(tied) == 300
    # First in the list, whatever its value: a profile file lists limits in its own order.
    assert Time().select(list(reversed(tied))) == 250


# 7 ---------------------------------------------------------------------------------------------
def test_reads_a_profile_file_written_by_zeus(training: ReplayTraining, tmp_path: Path) -> None:
    path = tmp_path / "zeus_profile.json"
    measurements = [
        {"power_limit": 300, "energy": 840.0, "time": 3.0},
        {"power_limit": 250, "energy": 764.4, "time": 3.12},
        {"power_limit": 200, "energy": 683.1, "time": 3.45},
    ]
    path.write_text(json.dumps({"measurements": measurements}, indent=4))  # all Zeus writes
    opt = make(training, profile_path=path, optimum_selector=Energy())
    assert profiled(opt) == [300, 250, 200]
    assert limits_now() == [200, 200]
    assert training.step_limits == []  # no profiling
    # Keys Zeus ignores (e.g. a newer writer's) are ignored here too.
    extra = {"measurements": [dict(measurements[0], note="x")], "written_by": "zeus 0.99"}
    path.write_text(json.dumps(extra))
    assert profiled(make(training, profile_path=path)) == [300]


# 8 ---------------------------------------------------------------------------------------------
def test_gpus_with_different_limit_ranges_are_refused() -> None:
    fake.reset(num_gpus=2, min_limit_mw=160_000, max_limit_mw=300_000)
    fake.STATE.gpus[1].min_limit_mw = 150_000
    training = ReplayTraining(TABLE, [0, 1])
    with pytest.raises(ValueError, match="range"):
        make(training)


def test_limits_are_not_rounded_to_whole_watts() -> None:
    fake.reset(num_gpus=1, min_limit_mw=100_500, max_limit_mw=250_500)
    monitor = ReplayMonitor(ReplayTraining({}, [0]))
    opt = GlobalPowerLimitOptimizer(
        monitor, wait_steps=0, warmup_steps=1, profile_steps=1, pl_step=50, restore_on_exit=False
    )
    for _ in range(9):
        opt.on_step_begin()
    # Zeus walks the ladder in milliwatts and records each limit as whole watts, truncated.
    assert [mw for _, mw in fake.STATE.set_calls][:3] == [200_500, 150_500, 100_500]
    assert profiled(opt) == [250, 200, 150, 100]


def test_a_chosen_limit_is_set_as_measured_not_as_its_whole_watts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Measured at 150,500 mW and recorded as 150 W: setting 150,000 mW ran the GPU at a limit
    # nobody measured, and a choice of the lowest (100 W) was "outside this GPU's range".
    fake.reset(num_gpus=1, min_limit_mw=100_500, max_limit_mw=250_500)
    for best in (150, 100):
        energies = {250: 90.0, 200: 80.0, 150: 70.0, 100: 75.0 if best == 150 else 60.0}
        path = tmp_path / f"profile{best}.json"
        rows = [{"power_limit": w, "energy": e, "time": 1.0} for w, e in energies.items()]
        path.write_text(json.dumps({"measurements": rows}))
        opt = GlobalPowerLimitOptimizer(
            ReplayMonitor(ReplayTraining({}, [0])),
            Energy(),
            profile_path=path,
            restore_on_exit=False,
        )
        assert opt.state == Done(optimal_power_limit=best * 1000 + 500)
        assert [gpu.limit_mw for gpu in fake.STATE.gpus] == [best * 1000 + 500]
        assert opt.profile().optimal_power_limit == best  # type: ignore[union-attr]
    assert "outside this GPU's range" not in caplog.text


# 9 ---------------------------------------------------------------------------------------------
def test_hf_wrapper_takes_the_optimizers_arguments() -> None:
    wrapper = inspect.signature(HFGlobalPowerLimitOptimizer.__init__).parameters
    optimizer = inspect.signature(GlobalPowerLimitOptimizer.__init__).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in wrapper.values())
    assert [(p.name, p.kind, p.default) for p in wrapper.values()] == [
        (p.name, p.kind, p.default) for p in optimizer.values()
    ]


# 10 --------------------------------------------------------------------------------------------
def test_close_restores_the_maximum_even_if_nothing_was_written(
    training: ReplayTraining, tmp_path: Path
) -> None:
    path = tmp_path / "profile.json"
    measured = {"power_limit": 200, "energy": 1.0, "time": 1.0}
    path.write_text(json.dumps({"measurements": [measured], "optimal_power_limit": 200}))
    for gpu in fake.STATE.gpus:  # a crashed run left the GPUs at the optimum
        gpu.limit_mw = 200_000
    opt = make(training, profile_path=path)
    assert limits_set() == []  # already there
    opt.close()
    assert limits_now() == [300, 300]


# 11 --------------------------------------------------------------------------------------------
def test_training_after_close_during_profiling(training: ReplayTraining) -> None:
    opt = make(training, optimum_selector=Time())
    run_steps(opt, training, 1 + WARMUP + 1)  # inside 300 W's window
    opt.close()
    assert limits_now() == [300, 300]
    run_steps(opt, training, 40)  # Trainer.train() again
    assert profiled(opt) == [300, 250, 200]
    expected = [PROFILE * TABLE[pl][0] for pl in (300, 250, 200)]
    assert [x.time for x in opt.measurements] == pytest.approx(expected)


def test_training_after_close_during_warmup_measures_the_right_limit(
    training: ReplayTraining,
) -> None:
    opt = make(training, optimum_selector=Time())
    run_steps(opt, training, 1 + WARMUP + PROFILE + 1)  # 250 W warming up
    opt.close()
    assert limits_now() == [300, 300]
    run_steps(opt, training, 40)
    for x in opt.measurements:  # each limit measured at that limit, not at 300 W
        seconds, watts = TABLE[x.power_limit]
        assert x.time == pytest.approx(PROFILE * seconds)
        assert x.energy == pytest.approx(2 * PROFILE * seconds * watts)


def test_training_after_close_when_done_goes_back_to_the_optimum(
    training: ReplayTraining,
) -> None:
    opt = make(training, optimum_selector=Energy())
    run_steps(opt, training, 40)
    optimum = limits_now()[0]
    assert optimum < 300
    opt.close()
    assert limits_now() == [300, 300]
    run_steps(opt, training, 2)
    assert training.step_limits[-2:] == [optimum, optimum]
    opt.close()
    assert limits_now() == [300, 300]


# Zeus's reader: pydantic (v1) models, unknown keys ignored, every number positive.
class ZeusMeasurement(BaseModel):
    power_limit: PositiveInt
    energy: PositiveFloat
    time: PositiveFloat


class ZeusProfileFile(BaseModel):
    measurements: list[ZeusMeasurement]


def test_zeus_reads_the_profile_file_written_here(training: ReplayTraining, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    opt = make(training, profile_path=path, optimum_selector=Energy())
    run_steps(opt, training, 40)
    as_zeus = ZeusProfileFile.model_validate_json(path.read_text())
    assert [(z.power_limit, z.energy, z.time) for z in as_zeus.measurements] == [
        (x.power_limit, x.energy, x.time) for x in opt.measurements
    ]
    # Zeus, given the same file and selector, keeps the limit this run kept.
    assert limits_now() == [Energy().select(opt.measurements)] * 2
    assert min(as_zeus.measurements, key=lambda z: z.energy).power_limit == limits_now()[0]
    # And a second run here reads it back.
    again = make(training, profile_path=path, optimum_selector=Energy())
    assert again.measurements == opt.measurements


def test_states_count_down_as_zeus_does(training: ReplayTraining) -> None:
    """Zeus's defaults (wait 1, warm-up 10, measure 40): each state's steps is what is left."""
    opt = make(training, warmup_steps=10, profile_steps=40)
    assert opt.state == Ready(next_power_limit=300_000, steps=2)
    seen = {}
    for step in range(1, 54):
        run_steps(opt, training, 1)
        seen[step] = copy.copy(opt.state)  # counted in place: a snapshot
    assert seen[1] == Ready(next_power_limit=300_000, steps=1)  # the wait step
    assert seen[2] == Warmup(current_power_limit=300_000, steps=10)  # limit set: warm-up 1
    assert seen[3] == Warmup(current_power_limit=300_000, steps=9)
    assert seen[11] == Warmup(current_power_limit=300_000, steps=1)  # warm-up step 10
    assert seen[12] == Profiling(current_power_limit=300_000, steps=40)  # the window begins
    assert seen[51] == Profiling(current_power_limit=300_000, steps=1)
    assert seen[52] == Warmup(current_power_limit=250_000, steps=10)  # 300 W measured
    assert seen[53] == Warmup(current_power_limit=250_000, steps=9)
    opt.on_epoch_end()
    assert opt.state == Ready(next_power_limit=250_000, steps=1)


# A deliberate difference -----------------------------------------------------------------------
def test_default_zeus_cost_counts_every_ranks_gpus(training: ReplayTraining) -> None:
    # Energy is summed over ranks, so the default's MaxPower counts every rank's GPUs: two
    # ranks of one GPU choose what one rank of two GPUs chooses from the same measurements.
    one_rank = make(training)
    run_steps(one_rank, training, 17)

    fake.reset(num_gpus=2, min_limit_mw=160_000, max_limit_mw=300_000)
    rank0 = ReplayTraining(TABLE, [0])
    two_ranks = GlobalPowerLimitOptimizer(
        ReplayMonitor(rank0),
        wait_steps=1,
        warmup_steps=WARMUP,
        profile_steps=PROFILE,
        pl_step=50,
        restore_on_exit=False,
        reducer=lambda seconds, joules: (seconds, 2 * joules),  # a twin rank on GPU 1
    )
    run_steps(two_ranks, rank0, 17)
    assert two_ranks.measurements == one_rank.measurements
    assert repr(two_ranks.optimum_selector) == "ZeusCost(eta_knob=0.5, world_size=2)"
    assert one_rank.state == two_ranks.state  # Done(250 W); world_size=1 chose 200 W
    assert two_ranks.state == Done(optimal_power_limit=250_000)


def test_every_zeus_callback_event_is_taken(training: ReplayTraining) -> None:
    """Zeus's optimizer is a ``zeus.callback.Callback``: a ``CallbackSet`` loop calls all seven.

    ``on_train_begin``, ``on_evaluate(metric)`` and ``on_train_end`` were missing here, so a
    Zeus training loop failed with AttributeError at its first line.
    """
    opt = make(training, optimum_selector=MaxSlowdownConstraint(1.05))
    opt.on_train_begin()
    for _epoch in range(4):
        opt.on_epoch_begin()
        for _ in range(7):
            opt.on_step_begin()
            training.step()
            opt.on_step_end()
        opt.on_epoch_end()
        training.idle(1.0)
        opt.on_evaluate(0.5)
    assert opt.state == Done(optimal_power_limit=250_000)
    assert profiled(opt) == [300, 250, 200] and limits_now() == [250, 250]
    opt.on_train_end()  # as the HF callback's on_train_end: the maximum limit is restored
    assert limits_now() == [300, 300]
    opt.on_step_begin()  # training goes on: back to the optimum
    assert limits_now() == [250, 250]


class Returns(OptimumSelector):
    """A user's selector that returns ``value`` whatever was measured."""

    def __init__(self, value: object) -> None:
        self.value = value

    def select(self, measurements: Any) -> Any:
        return self.value


@pytest.mark.parametrize("value", [250.0, np.float64(250.0), np.int64(250)])
def test_a_selector_returning_a_whole_number_of_another_type_sets_that_limit(
    training: ReplayTraining, value: object
) -> None:
    """Zeus's ``Done`` (a pydantic int) takes 250.0; NVML's ``c_uint`` refused a float."""
    opt = make(training, optimum_selector=Returns(value))
    run_steps(opt, training, 17)
    assert opt.state == Done(optimal_power_limit=250_000)
    assert type(opt.state.optimal_power_limit) is int
    assert [type(mw) for _, mw in fake.STATE.set_calls] == [int] * len(fake.STATE.set_calls)
    assert limits_now() == [250, 250]


@pytest.mark.parametrize("value", [251.5, None, "250", True, float("nan")])
def test_a_selector_returning_no_whole_number_is_a_config_error_naming_it(
    training: ReplayTraining, value: object
) -> None:
    opt = make(training, optimum_selector=Returns(value))
    with pytest.raises(ConfigError) as info:
        run_steps(opt, training, 17)
    assert str(info.value) == (
        f"optimum_selector Returns(value={value!r}) returned {value!r}, not a power limit in "
        "whole watts"
    )


def test_hf_callback_takes_every_trainer_event_in_the_trainers_order(
    training: ReplayTraining,
) -> None:
    # transformers' Trainer (4.4x) calls every TrainerCallback event; without transformers
    # installed the callback's stand-in base must have them too.
    cb = HFGlobalPowerLimitOptimizer(
        ReplayMonitor(training),
        wait_steps=1,
        warmup_steps=WARMUP,
        profile_steps=PROFILE,
        pl_step=50,
        restore_on_exit=False,
    )
    a = (None, None, None)
    cb.on_init_end(*a)
    cb.on_train_begin(*a, model=None)
    for _ in range(3):
        cb.on_epoch_begin(*a)
        for _ in range(1 + WARMUP + PROFILE + 1):
            cb.on_step_begin(*a)
            training.step()
            cb.on_substep_end(*a)
            cb.on_pre_optimizer_step(*a)
            cb.on_optimizer_step(*a)
            cb.on_step_end(*a)
            cb.on_log(*a, logs={})
        cb.on_epoch_end(*a)
        cb.on_prediction_step(*a)
        cb.on_evaluate(*a, metrics={})
        cb.on_save(*a)
    cb.on_train_end(*a)
    assert profiled(cb.optimizer) == [300, 250, 200]
    assert limits_now() == [300, 300]
