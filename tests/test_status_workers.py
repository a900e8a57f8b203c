"""`perseus status` counts the rq workers that `rq info` counts: those whose record exists."""

from __future__ import annotations

from coordinator.status import snapshot
from coordinator.worker_loop import PerseusSimpleWorker
from protocol import keys


def test_a_killed_worker_whose_record_expired_is_no_longer_counted(r):
    workers = [PerseusSimpleWorker([keys.RQ_QUEUE], connection=r, name=n) for n in ("a", "b")]
    for worker in workers:
        worker.register_birth()
    assert snapshot(r)["rq"]["workers"] == 2
    # SIGKILLed: no death recorded; its record expires, its entries in rq's sets stay until
    # a worker's registry maintenance, up to 10 minutes later.
    r.delete(workers[1].key)
    assert r.sismember("rq:workers:" + keys.RQ_QUEUE, workers[1].key)
    assert snapshot(r)["rq"]["workers"] == 1
