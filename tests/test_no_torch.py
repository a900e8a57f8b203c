"""The coordinator, rq workers and the planner work where torch cannot be imported.

torch is the training hook's dependency only (the ``[torch]`` extra); the services' image and an
operator's machine have none. Every process here runs with torch made unimportable.
"""

from __future__ import annotations

import json
import subprocess
import sys

from protocol.constants import H100_GRAPHICS_CLOCKS
from protocol.models import JobInfo, RankInfo
from protocol.store import JobStore
from schedulers.planning.synthetic_profile import write_synthetic_profile
from tests.helpers import run_perseus, start_perseus, stop, wait_for
from tests.import_blocker import blocking_env
from worker_client.hook.session import CoordinatorClient

REASON = "is not installed here (test_no_torch)"


def perseus(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_perseus(list(args), 300, env)


def test_services_and_planner_run_without_torch(r, redis_url, tmp_path):
    env = blocking_env(tmp_path, ["torch"], REASON)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
    assert probe.returncode != 0 and REASON.encode() in probe.stderr

    # Planner: optimize, then choose, from a synthetic 2-stage profile.
    profile = write_synthetic_profile(tmp_path / "profile.csv", 2)
    out = tmp_path / "plans"
    args = ["optimize", str(profile), "-s", "2", "-m", "2", "--unit-time", "0.002"]
    done = perseus(env, *args, "--out", str(out), "--no-plot")
    assert done.returncode == 0, done.stderr
    done = perseus(env, "choose", str(out))
    assert done.returncode == 0, done.stderr

    # Services: a coordinator and a forking rq worker serve a job from that frontier.
    frontier = ["--scheduler", "FrontierScheduler", "--scheduler-args"]
    frontier.append(json.dumps({"frontier_dir": str(out)}))
    services = [
        start_perseus(["coordinator", "--redis-url", redis_url, *frontier], tmp_path, "c.log", env),
        start_perseus(["worker", "--redis-url", redis_url], tmp_path, "w.log", env),
    ]
    try:
        client = CoordinatorClient(redis_url)
        job = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
        job_id = client.register_job(job)  # the coordinator's FrontierScheduler
        for rank in range(2):
            info = RankInfo(
                rank=rank,
                dp_rank=0,
                pp_rank=rank,
                tp_rank=0,
                available_frequencies=list(H100_GRAPHICS_CLOCKS),
            )
            client.register_rank(job_id, info)
        store = JobStore(r)
        wait_for(lambda: store.version(job_id) >= 1, 60, "version 1 from a worker without torch")
        assert store.get_job(job_id).error in (None, "")
        status = perseus(env, "status", "--redis-url", redis_url)
        assert status.returncode == 0 and job_id in status.stdout
    finally:
        stop(services)
    for log in ("c.log", "w.log"):
        text = (tmp_path / log).read_text()
        assert REASON not in text and "Traceback" not in text, text[-2000:]
