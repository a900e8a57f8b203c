"""`perseus worker --name N` after a worker N was killed: takes the name over, or says why not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rq.worker import SimpleWorker

from coordinator.worker_names import PROCESS_FIELD
from tests.helpers import ROOT, invoke_perseus, start_perseus, stop, subprocess_env, wait_for

NAME = "w2"
KEY = SimpleWorker.redis_worker_namespace_prefix + NAME


def registered_pid(r) -> int:
    return int(r.hget(KEY, "pid") or 0)


def start_worker(redis_url: str, tmp_path, log: str) -> subprocess.Popen:
    return start_perseus(["worker", "--redis-url", redis_url, "--name", NAME], tmp_path, log)


def killed_worker(redis_url: str, tmp_path, r) -> int:
    """Start worker w2, wait until it is registered, SIGKILL it; return its pid."""
    worker = start_worker(redis_url, tmp_path, "killed.log")
    wait_for(lambda: registered_pid(r) == worker.pid, 30, "the worker to register")
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    return worker.pid


def run_worker(redis_url: str, tmp_path) -> subprocess.CompletedProcess[str]:
    """`perseus worker --name w2` that is expected to exit at once."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "worker",
            "--redis-url",
            redis_url,
            "--name",
            NAME,
        ],
        env=subprocess_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_restarted_worker_takes_over_the_name_of_a_killed_one(tmp_path, redis_url, r):
    dead = killed_worker(redis_url, tmp_path, r)
    assert r.exists(KEY) and not r.hexists(KEY, "death") and r.ttl(KEY) > 60
    worker = start_worker(redis_url, tmp_path, "restarted.log")
    try:
        wait_for(lambda: registered_pid(r) == worker.pid, 30, "the new worker to register")
        assert worker.poll() is None
        log = (tmp_path / "restarted.log").read_text()
        assert f"(pid {dead} on host" in log and "taking over the name" in log
        assert "Traceback" not in log
    finally:
        stop([worker])


def test_name_of_a_live_worker_is_refused_with_advice(tmp_path, redis_url, r):
    live = start_worker(redis_url, tmp_path, "live.log")
    try:
        wait_for(lambda: registered_pid(r) == live.pid, 30, "the worker to register")
        done = run_worker(redis_url, tmp_path)
        assert done.returncode == 1
        assert "Traceback" not in done.stderr
        [error] = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
        assert f"rq worker name {NAME!r} is taken: Redis key {KEY}" in error
        assert f"(pid {live.pid} on host" in error
        # Alive on this machine: not "may still be running", nor advice to delete its key.
        assert "is running (its process is alive on this machine)" in error
        assert "another --name" in error and "redis-cli DEL" not in error
        assert live.poll() is None and registered_pid(r) == live.pid
    finally:
        stop([live])


def test_a_dead_worker_that_cannot_be_checked_keeps_its_name(tmp_path, redis_url, r):
    dead = killed_worker(redis_url, tmp_path, r)
    # As if it had run on another machine (another boot id): its pid means nothing here.
    namespace = os.readlink("/proc/self/ns/pid")
    r.hset(KEY, PROCESS_FIELD, f"another-boot/{namespace}/{dead}/1")
    done = run_worker(redis_url, tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"Error: rq worker name {NAME!r} is taken" in done.stderr
    assert "may still be running" in done.stderr and f"redis-cli DEL {KEY}" in done.stderr
    # Nor one whose record does not say which process it was (an older worker's).
    r.hdel(KEY, PROCESS_FIELD)
    done = run_worker(redis_url, tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"Error: rq worker name {NAME!r} is taken" in done.stderr
    assert not r.hexists(KEY, "death")


def test_a_process_that_cannot_be_looked_at_counts_as_alive(monkeypatch):
    """/proc mounted hidepid, or another user's worker: maybe alive, so never taken over."""
    from coordinator import worker_names

    child = subprocess.Popen(["sleep", "30"])
    try:
        identity = worker_names.process_identity(child.pid)
        assert identity is not None and not worker_names.process_gone(identity)
        hidden = f"/proc/{child.pid}/stat"
        real_read = worker_names._read
        monkeypatch.setattr(
            worker_names, "_read", lambda path: None if path == hidden else real_read(path)
        )
        assert not worker_names.process_gone(identity)
    finally:
        child.kill()
        child.wait()  # reaped: no zombie left with its PID
    assert worker_names.process_gone(identity)


def test_the_loop_takes_back_its_own_name_after_an_outage_kept_its_death_unrecorded(
    redis_url, r, monkeypatch, caplog
):
    """Its first worker registered, then Redis failed, even for recording its death."""
    import logging

    import redis as redis_py

    from coordinator import worker_loop
    from coordinator.worker_loop import PerseusSimpleWorker, run_workers
    from protocol import keys

    real_work = PerseusSimpleWorker.work
    calls = []

    def work(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            self.register_birth()
            raise redis_py.ConnectionError("Redis went away")
        self.stop_requested = True  # one round of real work, then the loop ends
        return real_work(self, burst=True)

    def no_death(self, *args, **kwargs):
        raise redis_py.ConnectionError("Redis went away")

    monkeypatch.setattr(PerseusSimpleWorker, "work", work)
    monkeypatch.setattr(PerseusSimpleWorker, "register_death", no_death)
    monkeypatch.setattr(worker_loop, "MAX_PAUSE_S", 0.1)
    conn = redis_py.Redis.from_url(redis_url)
    with caplog.at_level(logging.WARNING, logger="coordinator.worker_names"):
        restarts = run_workers(
            lambda: PerseusSimpleWorker([keys.RQ_QUEUE], connection=conn, name="wX")
        )
    # Failed on Redis; rq refused the name (its record still live); taken back; ran.
    assert len(calls) == 3 and restarts == 1
    assert "is an earlier worker of this process whose death was not recorded" in caplog.text


def test_a_killed_worker_not_yet_reaped_counts_as_dead():
    """Right after SIGKILL the process is a zombie until its parent reaps it (PID 1 took about
    a second here): `perseus worker --name N` restarted at once was refused for 8 minutes."""
    from coordinator import worker_names

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = worker_names.process_identity(proc.pid)
        assert identity is not None and not worker_names.process_gone(identity)
        os.kill(proc.pid, signal.SIGKILL)
        # Not reaped: Popen waits only when asked to.
        stat = Path(f"/proc/{proc.pid}/stat")
        wait_for(lambda: stat.read_text().rpartition(")")[2].split()[0] == "Z", 10, "a zombie")
        assert worker_names.process_gone(identity)
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_name_redis_cli_could_not_quote_easily_is_refused(redis_url):
    # 'a b:c' was taken as it was: its record rq:worker:a b:c needs quoting in the README's
    # `redis-cli DEL rq:worker:N`, and `perseus status` showed a name that reads as two.
    for bad in ("a b:c", "", "-x", "n" * 201):
        code, out = invoke_perseus("worker", "--name", bad, "--burst", "--redis-url", redis_url)
        assert code == 2 and "--name" in out and "letters, digits" in out, (bad, out)
    code, out = invoke_perseus(
        "worker",
        "--name",
        "host-1.gpu_0@rack+2",
        "--burst",
        "--no-preload",
        "--redis-url",
        redis_url,
    )
    assert code == 0, out
