"""End to end with real processes: coordinator and rq worker via the CLI, ranks on gloo."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from protocol import keys
from protocol.store import JobStore
from tests.helpers import run_perseus, start_perseus, subprocess_env
from tests.rank_helpers import collect_ranks, join_ranks, spawn_ranks, write_1f1b_plan

PP, MICROBATCHES = 4, 4
STAGE_CLOCKS = [(1980, 1980), (1830, 1905), (1710, 1800), (1605, 1710)]  # (forward, backward)


def write_plan(path: Path) -> list[list[tuple[str, int]]]:
    return write_1f1b_plan(path, PP, MICROBATCHES, STAGE_CLOCKS)


def launch_job(world: int, dp: int, redis_url: str, out: Path, meta: str, steps: int):
    assert world == dp * PP
    return spawn_ranks(world, PP, redis_url, out, meta, steps, MICROBATCHES)


def collect(procs, out: Path, meta: str, world: int) -> list[dict]:
    assert len(procs) == world
    return collect_ranks(procs, out, meta)


@pytest.fixture
def services(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    plan = tmp_path / "freqs_pipeline_00001.py"
    stages = write_plan(plan)
    args = json.dumps({"solution_path": str(plan)})
    started = [
        start_perseus(
            [
                "coordinator",
                "--redis-url",
                redis_url,
                "--scheduler",
                "PointSolution3D",
                "--scheduler-args",
                args,
            ],
            tmp_path,
            "coordinator.log",
        ),
        start_perseus(["worker", "--redis-url", redis_url], tmp_path, "worker.log"),
    ]
    yield stages
    for p in started:
        p.terminate()
        p.wait(timeout=10)


def test_two_jobs_end_to_end(services, tmp_path, redis_url, r):
    stages = services
    out = tmp_path / "out"
    out.mkdir()
    steps = 8
    job_a = launch_job(8, 2, redis_url, out, "jobA", steps)
    job_b = launch_job(4, 1, redis_url, out, "jobB", steps)
    recs_a = collect(job_a, out, "jobA", 8)
    recs_b = collect(job_b, out, "jobB", 4)

    ids_a = {rec["job_id"] for rec in recs_a}
    ids_b = {rec["job_id"] for rec in recs_b}
    assert len(ids_a) == 1 and len(ids_b) == 1 and ids_a != ids_b
    (job_a_id,), (job_b_id,) = ids_a, ids_b
    assert "+dp2+pp4+tp1+PointSolution3D+jobA" in job_a_id

    # Every rank ran its stage's planned clocks, instruction by instruction, every step.
    for rec in recs_a + recs_b:
        planned = [f for _, f in stages[rec["pp_rank"]]]
        assert rec["frequencies"] == planned * steps, rec["rank"]

    store = JobStore(r)
    for job_id, world in ((job_a_id, 8), (job_b_id, 4)):
        # Results of version 1 came from every rank and were observed by the scheduler.
        deadline = time.monotonic() + 30
        while len(store.journal(job_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        results = store.results(job_id, 1)
        assert sorted(res.rank for res in results) == list(range(world))
        for res in results:
            assert len(res.iter_time) == 2
            assert [len(it) for it in res.time_breakdown["forward"]] == [MICROBATCHES] * 2
        journal = store.journal(job_id)
        assert journal[0].observed_version is None and journal[1].observed_version == 1
        # PointSolution converged after one plan: the observation made no new version, so the
        # ranks kept version 1 and a long run does not grow the job's state.
        assert not journal[1].published and store.version(job_id) == 1
        assert [int(f[b"version"]) for _, f in r.xrange(keys.job_updates(job_id))] == [1]
    # The two jobs did not touch each other's state.
    assert store.ranks(job_a_id)[0].rank == 0 and len(store.ranks(job_a_id)) == 8
    assert len(store.ranks(job_b_id)) == 4
    assert r.xlen(keys.DEADLETTER_STREAM) == 0

    status = run_perseus(
        ["status", "--json", "--redis-url", redis_url], None, subprocess_env(tmp_path), check=True
    )
    snap = json.loads(status.stdout)
    assert {j["job_id"]: j["ranks"] for j in snap["jobs"]} == {job_a_id: 8, job_b_id: 4}


def test_when_rank_0_cannot_register_the_job_every_rank_fails_with_its_reason(redis_url, tmp_path):
    # A metadata tag with a space is refused by JobInfo on rank 0, before any Redis traffic: the
    # other rank must get that reason through the broadcast, not hang or fail on its own.
    meta = "bad meta"
    join_ranks(spawn_ranks(2, 2, redis_url, tmp_path, meta, steps=1, microbatches=2), 120)
    for rank in range(2):
        record = json.loads((tmp_path / f"{meta}-rank{rank}.json").read_text())
        assert "rank 0 could not register the job" in record["error"]
        assert "job_metadata='bad meta' must be 1-64 characters" in record["error"]
        assert "errors.pydantic.dev" not in record["error"]


def test_a_rank_that_cannot_open_its_gpu_fails_every_rank_before_a_job_exists(
    r, redis_url, tmp_path
):
    # CUDA device 1 is hidden from both ranks: rank 1 cannot drive it. No job may be
    # registered (one that nobody trains would sit as `starting`), and rank 0 says why.
    meta = "hidden-gpu"
    procs = spawn_ranks(2, 2, redis_url, tmp_path, meta, 1, 2, visible_devices="0")
    join_ranks(procs, 120)
    records = [json.loads((tmp_path / f"{meta}-rank{k}.json").read_text()) for k in range(2)]
    assert "device_id 1 is not a visible CUDA device" in records[1]["error"]
    assert "CUDA_VISIBLE_DEVICES='0'" in records[1]["error"]
    assert "no job registered; rank 1: ConfigError: device_id 1" in records[0]["error"]
    assert r.zcard(keys.JOBS_INDEX) == 0


def test_each_rank_drives_the_nvml_device_its_cuda_device_is(services, redis_url, tmp_path):
    # Rank r drives CUDA device r; CUDA_VISIBLE_DEVICES names NVML indices (or UUIDs).
    meta = "visible"
    procs = spawn_ranks(
        PP, PP, redis_url, tmp_path, meta, 1, MICROBATCHES, visible_devices="3,1,0,2"
    )
    records = collect_ranks(procs, tmp_path, meta, 120)
    assert [rec["gpu_index"] for rec in records] == [3, 1, 0, 2]
