"""`rq requeue` of a failed planner run: while it runs again, it is a live run like any other."""

from __future__ import annotations

from typing import Any

from rq.registry import FailedJobRegistry
from rq.worker import SimpleWorker

from protocol import keys
from schedulers.planning import job as planning_job
from schedulers.planning.job import enqueue_planning
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.planning.synthetic_profile import write_synthetic_profile


def test_a_requeued_run_is_watched_by_the_sweep_and_kept_while_it_runs(tmp_path, r, monkeypatch):
    profile = read_profile_csv(write_synthetic_profile(tmp_path / "profile.csv", 2))
    out = tmp_path / "out"
    out.write_text("a file where the output folder goes: the first attempt fails")
    pid = enqueue_planning(r, profile, 2, 4, out_dir=out, plan_id="again", plot=False)
    SimpleWorker([keys.RQ_QUEUE], connection=r).work(burst=True)
    key = keys.plan_key(pid)
    assert r.hget(key, "state") == b"failed" and r.ttl(key) > 0
    assert r.zscore(keys.PLANS_ACTIVE, pid) is None

    out.unlink()
    FailedJobRegistry(keys.RQ_QUEUE, connection=r).requeue(keys.plan_rq_job(pid))
    seen: dict[str, Any] = {}
    real = planning_job.plan_frontier

    def watched(*args: Any, **kw: Any) -> Any:
        seen.update(state=r.hget(key, "state"), ttl=r.ttl(key))
        seen["active"] = r.zscore(keys.PLANS_ACTIVE, pid) is not None
        return real(*args, **kw)

    monkeypatch.setattr(planning_job, "plan_frontier", watched)
    SimpleWorker([keys.RQ_QUEUE], connection=r).work(burst=True)
    # Running again: live (the sweep ends it if rq's job dies), no expiry meanwhile.
    assert seen == {"state": b"running", "ttl": -1, "active": True}
    assert r.hget(key, "state") == b"done" and r.ttl(key) > 0
    assert r.zscore(keys.PLANS_ACTIVE, pid) is None
