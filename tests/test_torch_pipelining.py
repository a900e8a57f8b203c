"""Perseus on torch.distributed.pipelining: orders, wrap-time checks, and 4-rank gloo runs."""

from __future__ import annotations

import json
import multiprocessing as mp
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleLoopedBFS

from coordinator.service import Coordinator
from protocol.constants import H100_GRAPHICS_CLOCKS
from protocol.exceptions import ConfigError, ScheduleError
from protocol.models import FrequencySchedule
from protocol.pipeline_schedules import stage_actions, stage_order
from protocol.store import JobStore
from schedulers.planning.plan_file import write_plan_file
from tests.helpers import free_ports, make_settings, running, start_perseus, stop, wait_for
from tests.pipelining_ranks import PipelineRank, run_rank
from tests.rank_helpers import join_ranks, make_hook
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.gpu.nvml import SIMULATED_NVML
from worker_client.integrations.torch_pipelining import PerseusPipeline, schedule_kind

CLASSES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


# --- the order torch runs -------------------------------------------------------------------
class RecordingStage:
    """Just enough of a PipelineStage for a schedule's _step_microbatches: records the actions."""

    def __init__(self, index: int, num_stages: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.has_backward = True
        self.ran: list[tuple[str, int]] = []

    def forward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.ran.append(("forward", chunk))
        return torch.zeros(1)

    def backward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:
        self.ran.append(("backward", chunk))

    def get_fwd_recv_ops(self, chunk: int) -> list[Any]:
        return []

    get_bwd_recv_ops = get_fwd_send_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, scale: int) -> None:
        pass


@pytest.mark.parametrize("kind", sorted(CLASSES))
@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 5), (3, 3), (4, 8), (5, 7), (8, 8)])
def test_planner_order_equals_what_torch_runs(kind: str, stages: int, micro: int) -> None:
    for index in range(stages):
        stage = RecordingStage(index, stages)
        schedule = CLASSES[kind](stage, micro, loss_fn=lambda out, target: out.sum())
        # Shape inference talks to the neighbours; the order does not depend on it.
        schedule._stage_forward_initialized = schedule._stage_backward_initialized = True
        schedule._step_microbatches(target_mbs=[torch.zeros(1)] * micro)
        assert stage.ran == stage_actions(kind, stages, micro, index), (kind, index)
        assert schedule_kind(schedule) == kind


def test_unsupported_schedules_are_refused_at_wrap_time() -> None:
    for cls in (ScheduleInterleaved1F1B, ScheduleLoopedBFS):
        with pytest.raises(ConfigError, match=f"{cls.__name__}: it runs several stages per rank"):
            schedule_kind(object.__new__(cls))

    class Reordered(Schedule1F1B):
        def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
            pass

    class Renamed(ScheduleGPipe):
        pass

    with pytest.raises(ConfigError, match="Reordered: it overrides _step_microbatches"):
        schedule_kind(object.__new__(Reordered))
    assert schedule_kind(object.__new__(Renamed)) == "gpipe"
    with pytest.raises(ConfigError, match="supported schedules: Schedule1F1B, ScheduleGPipe"):
        schedule_kind(object())


# --- one rank, in this process --------------------------------------------------------------
def one_stage_schedule(cls: type, microbatches: int, loss: bool = True) -> tuple[Any, Any]:
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, torch.device("cpu"))
    return cls(stage, microbatches, loss_fn=torch.nn.MSELoss() if loss else None), stage


def wrap(schedule: Any, redis_url: str, **kw: Any) -> PerseusPipeline:
    return PerseusPipeline(
        schedule,
        redis_url=redis_url,
        nvml_module=SIMULATED_NVML,
        controller=DryRunFrequencyController(0),
        schedule_timeout=20,
        **kw,
    )


def test_one_stage_runs_the_plan_and_swaps_between_steps(gloo, hook_service, redis_url):
    _coord, start_worker = (
        hook_service  # StepDown: F, B x 2 microbatches, one clock lower per round
    )
    start_worker()
    schedule, stage = one_stage_schedule(Schedule1F1B, 2)
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    with wrap(schedule, redis_url, report_every=1) as perseus:
        steps = 0
        while perseus.hook.schedule.version < 3:
            schedule.step(x, target=y)
            assert perseus.last_step_actions == stage_actions("1f1b", 1, 2, 0)
            steps += 1
            assert steps < 500, "no version 3"
        freqs = [f for _, f in perseus.hook.controller.records]  # type: ignore[attr-defined]
        per_step = [freqs[i : i + 4] for i in range(0, len(freqs), 4)]
        assert {tuple(f) for f in per_step} == {(1980,) * 4, (1965,) * 4}
        assert perseus.hook.swaps[0][1] == 2 and perseus.hook.swaps[-1][1] == 3
        schedule.eval(x, target=y)  # forward only: runs without the hook
        assert perseus.hook.steps == steps
    assert "step" not in vars(schedule) and "forward_one_chunk" not in vars(stage)


def test_a_second_wrap_is_refused_and_close_puts_back_what_it_found(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    schedule, stage = one_stage_schedule(Schedule1F1B, 2)
    calls = []
    original = stage.forward_one_chunk

    def users_patch(*args: Any, **kwargs: Any) -> Any:  # e.g. the user's own instrumentation
        calls.append(1)
        return original(*args, **kwargs)

    stage.forward_one_chunk = users_patch
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    with wrap(schedule, redis_url, report_every=1) as perseus:
        with pytest.raises(ConfigError, match="already wrapped by a PerseusPipeline; close"):
            wrap(schedule, redis_url)
        schedule.step(x, target=y)
        assert perseus.hook.steps == 1 and len(calls) == 2  # both microbatches, through both
    assert vars(stage)["forward_one_chunk"] is users_patch and "step" not in vars(schedule)
    with wrap(schedule, redis_url) as again:  # closed: it may be wrapped anew
        schedule.step(x, target=y)
        assert again.hook.steps == 1


def test_a_second_schedule_over_a_wrapped_stage_is_refused(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    first, stage = one_stage_schedule(Schedule1F1B, 2)
    second = Schedule1F1B(stage, 2, loss_fn=torch.nn.MSELoss())  # e.g. training rebuilt
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    with wrap(first, redis_url):
        # It would register a second job for the GPU, and closing the first would take its
        # patches off the stage (its next step then saw 0 of 4 actions).
        with pytest.raises(ConfigError, match=r"PipelineStage \(stage 0\) of this Schedule1F1B"):
            wrap(second, redis_url)
        assert "step" not in vars(second)
    with wrap(second, redis_url) as perseus:
        second.step(x, target=y)
        assert perseus.last_step_actions == stage_actions("1f1b", 1, 2, 0)


def test_plan_for_the_other_schedule_is_a_clear_error(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    schedule, _ = one_stage_schedule(ScheduleGPipe, 2)
    with pytest.raises(ScheduleError, match=r"in 1f1b order, but ScheduleGPipe runs 2 microbatch"):
        wrap(schedule, redis_url)
    schedule, _ = one_stage_schedule(Schedule1F1B, 4)
    with pytest.raises(
        ScheduleError, match=r"2 microbatches in 1f1b order, but Schedule1F1B runs 4"
    ):
        wrap(schedule, redis_url)


def test_no_loss_fn_is_refused(gloo, redis_url):
    schedule, _ = one_stage_schedule(Schedule1F1B, 2, loss=False)
    with pytest.raises(ConfigError, match="has no loss_fn"):
        wrap(schedule, redis_url)


def test_an_action_out_of_order_fails_and_the_next_step_starts_clean(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    schedule, stage = one_stage_schedule(Schedule1F1B, 2)
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    with wrap(schedule, redis_url) as perseus:
        schedule.step(x, target=y)
        stage.clear_runtime_states()

        def backwards_first(*args: Any, **kwargs: Any) -> None:
            stage.forward_one_chunk(1, (x[:2],), {})

        schedule._step_microbatches = backwards_first
        with pytest.raises(ScheduleError, match="ran forward of microbatch 1 as action 0, but"):
            schedule.step(x, target=y)
        del schedule._step_microbatches
        schedule.step(x, target=y)  # The hook starts the schedule over: no stale position.
        assert perseus.hook.steps == 2


# --- four ranks on gloo ---------------------------------------------------------------------
STAGES, MICRO = 4, 8


def plan_texts(kind: str, tmp_path: Path) -> list[list[list[tuple[str, int]]]]:
    """Two plans with a different clock at every position, so any slip shows."""
    clocks = H100_GRAPHICS_CLOCKS
    plans = []
    for offset in (0, 40):
        stages = [
            [
                (name, clocks[(offset + 3 * s + k) % 60])
                for k, (name, _) in enumerate(stage_actions(kind, STAGES, MICRO, s))
            ]
            for s in range(STAGES)
        ]
        write_plan_file(tmp_path / f"plan{offset}.py", stages, {"pipeline_schedule": kind})
        plans.append(stages)
    return plans


@pytest.fixture
def plan_service(r, redis_url, tmp_path, monkeypatch):
    """A coordinator serving two plans in turn (tests.toy_schedulers:PlanSequence), a worker."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    workers: list[Any] = []
    with ExitStack() as coordinators:

        def start(kind: str) -> list[list[list[tuple[str, int]]]]:
            plans = plan_texts(kind, tmp_path)
            texts = [(tmp_path / f"plan{o}.py").read_text() for o in (0, 40)]
            settings = make_settings(
                redis_url, "tests.toy_schedulers:PlanSequence", scheduler_args={"plans": texts}
            )
            coordinators.enter_context(running(Coordinator(r, settings)))
            workers.append(
                start_perseus(["worker", "--simple", "--redis-url", redis_url], tmp_path, "w.log")
            )
            return plans

        yield start
        stop(workers)


def launch(kind: str, redis_url: str, out: Path) -> list[dict[str, Any]]:
    init = f"tcp://127.0.0.1:{free_ports()[0]}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=run_rank,
            args=(PipelineRank(rank, STAGES, init, redis_url, kind, MICRO, str(out)), 3, 400),
        )
        for rank in range(STAGES)
    ]
    for p in procs:
        p.start()
    join_ranks(procs)  # a rank stuck at 240 s is killed, not left behind
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(STAGES)]
    for rec in records:
        assert "error" not in rec, rec["error"]
    return records


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_four_ranks_run_torch_schedule_under_the_plan(kind, plan_service, redis_url, r, tmp_path):
    plans = plan_service(kind)
    out = tmp_path / "out"
    out.mkdir()
    records = launch(kind, redis_url, out)
    (job_id,) = {rec["job_id"] for rec in records}
    for rec in records:
        rank = rec["rank"]
        actions = [tuple(a) for a in stage_actions(kind, STAGES, MICRO, rank)]
        assert all([tuple(a) for a in step] == actions for step in rec["actions"]), rank
        # One swap, between steps, to version 2; every action ran at its plan's clock.
        assert rec["first_version"] == 1
        ((swap_step, version),) = rec["swaps"]
        steps = len(rec["actions"])
        assert version == 2 and 2 <= swap_step <= steps - 2
        want = [f for _, f in plans[0][rank]] * swap_step
        want += [f for _, f in plans[1][rank]] * (steps - swap_step)
        assert rec["frequencies"] == want, rank
        assert rec["restored"]
    # The hook changes nothing numerically: same losses as the bare schedule, step by step.
    last = records[-1]
    assert len(last["bare_losses"]) == 3 and last["losses"][:3] == last["bare_losses"]
    assert len(set(last["losses"])) == len(last["losses"])  # training moved the loss
    # Both versions' results reached the coordinator from every rank.
    store = JobStore(r)
    for v in (1, 2):
        results = wait_for(lambda v=v: len(store.results(job_id, v)) == STAGES, 20, f"v{v} results")
        assert results
        for res in store.results(job_id, v):
            assert [len(it) for it in res.time_breakdown["forward"]] == [MICRO] * 2
            assert [len(it) for it in res.time_breakdown["backward"]] == [MICRO] * 2


def test_a_hook_for_another_stage_is_refused(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    hook = make_hook(redis_url, DryRunFrequencyController(0))
    try:
        stage = PipelineStage(torch.nn.Linear(4, 4), 1, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, 2, loss_fn=torch.nn.MSELoss())
        with pytest.raises(
            ConfigError, match="hook is for pp_rank 0 of pp_degree 1 but the schedule's stage is 1"
        ):
            PerseusPipeline(schedule, hook)
        # The right stage index in a pipeline of another length: GPipe's order alone (every
        # forward, then every backward) is the same for stage 0 of 1 and of 2.
        first = PipelineStage(torch.nn.Linear(4, 4), 0, 2, torch.device("cpu"))
        with pytest.raises(ConfigError, match="pp_degree 1 but the schedule's stage is 0 of 2"):
            PerseusPipeline(ScheduleGPipe(first, 2, loss_fn=torch.nn.MSELoss()), hook)
        with pytest.raises(ConfigError, match="either hook or hook options"):
            PerseusPipeline(schedule, hook, report_every=3)
        # The layout too: the hook has its own, and these were dropped unsaid.
        for layout in ({"device_id": 5}, {"dp_rank": 1, "dp_degree": 2}, {"tp_degree": 2}):
            with pytest.raises(ConfigError, match=f"not both: .*{next(iter(layout))}"):
                PerseusPipeline(schedule, hook, **layout)
    finally:
        hook.close()


@pytest.mark.parametrize(("kind", "micro"), [("1f1b", 8), ("gpipe", 4)])
def test_a_later_stage_names_the_served_schedule_it_got(kind: str, micro: int) -> None:
    # The last of 2 stages runs Schedule1F1B with 4 microbatches; the plan served to it is
    # another schedule's or microbatch count's order *for that stage*.
    pipeline = object.__new__(PerseusPipeline)
    pipeline.schedule = object.__new__(Schedule1F1B)
    pipeline.kind, pipeline.num_stages, pipeline.stage_index, pipeline.num_microbatches = (
        "1f1b",
        2,
        1,
        4,
    )
    pipeline._names = [name for name, _ in stage_actions("1f1b", 2, 4, 1)]
    pipeline._checked_version = -1
    served = [(name, 1980) for name in stage_order(kind, 2, micro, 1)]
    pipeline.hook = SimpleNamespace(  # type: ignore[assignment]
        rank=1, schedule=FrequencySchedule(rank=1, frequencies=served, version=3)
    )
    what = f"{micro} microbatches in 1f1b order" if kind == "1f1b" else "gpipe order"
    with pytest.raises(ScheduleError, match=f"runs {2 * micro} instructions in {what}, but"):
        pipeline._check_served_order()


@pytest.mark.parametrize(
    ("args", "kw", "words"),
    [
        # The URL where the hook goes: "'str' object has no attribute 'pp_rank'".
        (("redis://localhost:6379/0",), {}, "hook must be a PerseusOptimizer or None, got 'redis"),
        ((), {"tp_degree": 0}, "tp_degree must be >= 1, got 0"),  # a ZeroDivisionError
        ((), {"dp_rank": "0"}, "dp_rank must be a whole number (int), got '0' (str)"),
        ((), {"device_id": 0.0}, "device_id must be a whole number (int), got 0.0 (float)"),
    ],
)
def test_bad_wrap_arguments_are_named(
    gloo: None, r: Any, redis_url: str, args: tuple[Any, ...], kw: dict[str, Any], words: str
) -> None:
    schedule, _ = one_stage_schedule(Schedule1F1B, 2)
    with pytest.raises(ConfigError) as info:
        if args:
            PerseusPipeline(schedule, *args)
        else:
            wrap(schedule, redis_url, **kw)
    assert words in str(info.value)
    assert r.dbsize() == 0  # nothing was registered


def test_zeus_server_url_as_a_hook_option_is_refused_naming_redis_url(gloo: None, r: Any) -> None:
    # Passed on to PerseusOptimizer(**options): Python's bare TypeError, naming nothing else.
    schedule, _ = one_stage_schedule(Schedule1F1B, 2)
    with pytest.raises(ConfigError) as info:
        PerseusPipeline(schedule, server_url="http://localhost:7787", nvml_module=SIMULATED_NVML)
    words = str(info.value)
    assert "PerseusPipeline" in words and "server_url" in words, words
    assert "redis_url" in words and "perseus coordinator" in words, words
    assert r.dbsize() == 0
