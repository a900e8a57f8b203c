"""What `perseus worker` logs while Redis is down: one line when it goes, one when it is back.

rq logs an ERROR for each failed reconnect of its work loop (every 1 to 5 s) and of its pubsub
thread (every 2 s): a ten-minute outage wrote hundreds of lines, none saying when it ended.
"""

from __future__ import annotations

import logging
import re
import sys

import pytest
import redis
from rq import Queue
from rq.job import JobStatus

from coordinator.embedded import EmbeddedRedis
from coordinator.worker_outage import OutageLog
from protocol import keys
from tests.helpers import start_perseus, stop, wait_for


def test_an_idle_worker_logs_an_outage_once_and_its_end_once(tmp_path):
    with EmbeddedRedis(appendonly=True) as server:
        worker = start_perseus(["worker", "--redis-url", server.url], tmp_path, "w.log")
        log = tmp_path / "w.log"
        try:
            wait_for(lambda: "Listening on perseus" in log.read_text(), 30, "the worker")
            server.restart(downtime=8.0)
            wait_for(lambda: "answers again" in log.read_text(), 30, "the worker's reconnect")
            text = log.read_text()
        finally:
            stop([worker])
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert not errors, text
    down = re.findall(r"redis unavailable .*", text)
    assert len(down) == 1, text
    assert "retrying" in down[0]
    assert re.search(r"redis answers again after \d+(\.\d+)? s", text), text


def test_an_outage_that_ends_rqs_work_loop_is_still_said_to_end(tmp_path):
    # Redis goes away during a task: rq's pubsub thread logs the outage, the bookkeeping after
    # the task fails, rq's work loop quits, and `perseus worker` starts a fresh rq worker once
    # Redis answers. The fresh worker's log knew nothing of the outage: its end went unsaid.
    with EmbeddedRedis(appendonly=True) as server:
        worker = start_perseus(["worker", "--redis-url", server.url], tmp_path, "w.log")
        log = tmp_path / "w.log"
        try:
            wait_for(lambda: "Listening on perseus" in log.read_text(), 30, "the worker")
            queue = Queue(keys.RQ_QUEUE, connection=redis.Redis.from_url(server.url))
            task = queue.enqueue("time.sleep", 3)
            wait_for(lambda: task.get_status() == JobStatus.STARTED, 30, "the task to start")
            server.restart(downtime=8.0)
            wait_for(lambda: "starting a new rq worker" in log.read_text(), 30, "a fresh worker")
            wait_for(lambda: "answers again" in log.read_text(), 30, "the outage's end")
            text = log.read_text()
        finally:
            stop([worker])
    assert len(re.findall(r"redis unavailable", text)) == 1, text
    assert re.search(r"redis answers again after \d+(\.\d+)? s", text), text


@pytest.mark.skipif(sys.version_info < (3, 11), reason="logging skips its own frames from 3.11")
def test_rqs_records_name_rqs_line_not_the_wrapper():
    # Every record of rq's worker logger goes through OutageLog.log: %(funcName)s, %(lineno)d
    # and %(pathname)s named worker_outage.py's log() for all of them.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tests.rq_worker_records")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    log = OutageLog(logger, "w")
    log.info("Worker %s: started", "w")
    log.exception("Worker %s: failed", "w")
    assert [r.funcName for r in records] == [sys._getframe().f_code.co_name] * 2
    assert {r.pathname for r in records} == {__file__}
