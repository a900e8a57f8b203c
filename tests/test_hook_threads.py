"""The hook's background threads end when told to, and lose nothing without saying so.

A silent network (packets dropped, no connection refused) is played by
:class:`~tests.silent_proxy.SilentProxy` in front of the suite's real Redis.
"""

from __future__ import annotations

import time

from protocol import keys
from protocol.models import JobConfig, JobInfo
from protocol.store import JobStore
from tests.helpers import wait_for
from tests.silent_proxy import SilentProxy
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import STOP_TIMEOUT_S, ScheduleWatcher


def new_job(r, job_id: str) -> None:
    """A one-rank job straight in the store."""
    job = JobInfo(job_id=job_id, pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    JobStore(r).create_job(job, JobConfig(scheduler="x"), "1-0")


def test_stop_ends_a_watcher_whose_heartbeat_hangs_on_a_silent_network(r, redis_url):
    new_job(r, "quiet")
    with SilentProxy(redis_url) as proxy:
        # The client's own socket time-out is long (reply_timeout + 30 s): registrations
        # block for reply_timeout.
        client = CoordinatorClient(proxy.url, reply_timeout=10)
        watcher = ScheduleWatcher(client, "quiet", rank=0, version=0, heartbeat_interval=0.2)
        # The network goes silent as the first heartbeat goes out.
        proxy.silence_from(keys.job_alive("quiet").encode())
        watcher.start()
        wait_for(lambda: proxy.dropped > 0, 10, "the heartbeat dropped by the network")
        time.sleep(0.2)  # the heartbeat is waiting for its reply
        started = time.monotonic()
        watcher.stop()
        took = time.monotonic() - started
        assert took < STOP_TIMEOUT_S + 0.5
        assert not watcher.is_alive(), "the watcher outlived stop()"
        assert watcher.error is None and watcher.outage.since is None
        client.close()
    assert r.zcard(keys.job_alive("quiet")) == 0  # no heartbeat got through, before or after
