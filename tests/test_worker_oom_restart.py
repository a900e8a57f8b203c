"""A `perseus worker` whose rq loop quit while Redis was out of memory rides the OOM out.

Its record could not be marked dead during the OOM, so rq refused the next worker's name, and
taking the name back wrote to Redis too: the OOM then ended the whole process with a
traceback (seen with `perseus worker --name w2` busy in a task when `maxmemory` was reached).
"""

from __future__ import annotations

import logging

import redis as redis_py
from rq import worker_registration

from coordinator import worker_loop
from coordinator.worker_loop import PerseusSimpleWorker, run_workers
from protocol import keys


def test_a_worker_whose_name_cannot_be_taken_back_during_an_oom_waits_for_memory(
    redis_url, r, monkeypatch, caplog
):
    real_work = PerseusSimpleWorker.work
    calls: list[int] = []

    def work(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # registered, then Redis filled up: rq's loop quits
            self.register_birth()
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)
            raise redis_py.exceptions.OutOfMemoryError("OOM command not allowed")
        if len(calls) == 3:  # memory freed meanwhile
            r.config_set("maxmemory", 0)
        if len(calls) >= 4:
            self.stop_requested = True  # one round of real work, then the loop ends
        return real_work(self, burst=True)

    real_birth = PerseusSimpleWorker.register_birth
    births: list[tuple[bool, bool]] = []

    def register_birth(self):
        real_birth(self)
        # Earlier workers of the same name whose death Redis refused: not recorded over it.
        listed = r.sismember(worker_registration.REDIS_WORKER_KEYS, self.key)
        births.append((bool(listed), bool(r.hexists(self.key, "death"))))

    monkeypatch.setattr(PerseusSimpleWorker, "work", work)
    monkeypatch.setattr(PerseusSimpleWorker, "register_birth", register_birth)
    monkeypatch.setattr(worker_loop, "MAX_PAUSE_S", 0.1)
    conn = redis_py.Redis.from_url(redis_url)
    try:
        with caplog.at_level(logging.WARNING):
            restarts = run_workers(
                lambda: PerseusSimpleWorker([keys.RQ_QUEUE], connection=conn, name="wOOM")
            )
    finally:
        r.config_set("maxmemory", 0)
    # OOM; rq refused the name and it could not be taken back (OOM); taken back; ran.
    assert len(calls) == 4 and restarts == 2
    assert births[-1] == (True, False)  # the worker that ran was listed, and alive
    assert "could not take back its name" in caplog.text
    assert "is an earlier worker of this process whose death was not recorded" in caplog.text


def test_a_worker_whose_death_redis_refused_leaves_the_registry_once_writes_work(
    redis_url, r, monkeypatch
):
    # `perseus worker` without --name: each rq worker of the loop has a name of its own. The
    # first one's loop quit while Redis was out of memory, which answers PING but refuses the
    # write of its death: it stayed in rq:workers beside the next worker, and `perseus status`
    # and `rq info` counted two workers for minutes after memory was freed.
    real_work = PerseusSimpleWorker.work
    made: list[PerseusSimpleWorker] = []

    def work(self, *args, **kwargs):
        if len(made) == 1:  # registered, then Redis filled up: rq's loop quits
            self.register_birth()
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)
            raise redis_py.exceptions.OutOfMemoryError("OOM command not allowed")
        r.config_set("maxmemory", 0)  # memory freed before the next worker starts
        self.stop_requested = True
        return real_work(self, burst=True)

    def make() -> PerseusSimpleWorker:
        made.append(PerseusSimpleWorker([keys.RQ_QUEUE], connection=conn))
        return made[-1]

    monkeypatch.setattr(PerseusSimpleWorker, "work", work)
    monkeypatch.setattr(worker_loop, "MAX_PAUSE_S", 0.1)
    conn = redis_py.Redis.from_url(redis_url)
    try:
        assert run_workers(make) == 1
    finally:
        r.config_set("maxmemory", 0)
    assert len(made) == 2
    first = made[0]
    # The second one recorded its own death too.
    assert r.smembers(worker_registration.REDIS_WORKER_KEYS) == set()
    assert r.hexists(first.key, "death")
