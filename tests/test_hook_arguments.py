"""PerseusOptimizer refuses an argument of the wrong type or range by name, before starting."""

from __future__ import annotations

import math
from typing import Any

import pytest
import redis

from protocol.exceptions import ConfigError
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.gpu.nvml import SIMULATED_NVML
from worker_client.hook.optimizer import PerseusOptimizer


def _hook(redis_url: Any, **options: Any) -> PerseusOptimizer:
    """A one-rank hook on the simulated GPU; ``options`` replace any argument."""
    layout = dict.fromkeys(("rank", "dp_rank", "pp_rank", "tp_rank", "device_id"), 0)
    layout |= dict.fromkeys(("dp_degree", "pp_degree", "tp_degree", "world_size"), 1)
    args: dict[str, Any] = {
        **layout,
        "redis_url": redis_url,
        "nvml_module": SIMULATED_NVML,
        "controller": DryRunFrequencyController(0),
    }
    return PerseusOptimizer(**(args | options))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        # Taken before: a float failed in the result thread (iter_time[:2.5]), True was 1.
        ({"report_every": 2.5}, "report_every must be a whole number (int), got 2.5 (float)"),
        ({"report_every": True}, "report_every must be a whole number (int), got True (bool)"),
        # A TypeError from a comparison, naming nothing.
        ({"report_every": "10"}, "report_every must be a whole number (int), got '10' (str)"),
        ({"schedule_timeout": "5"}, "schedule_timeout must be a number of seconds, got '5'"),
        # NaN compares false with everything: no heartbeat was ever sent, no outage expired.
        ({"heartbeat_interval": math.nan}, "heartbeat_interval must be a finite number"),
        ({"heartbeat_interval": math.inf}, "heartbeat_interval must be a finite number"),
        ({"outage_timeout": math.nan}, "outage_timeout must be a finite number"),
        ({"schedule_timeout": math.inf}, "schedule_timeout must be a finite number"),
        # A heartbeat per 1 ms read of every rank's watcher.
        ({"heartbeat_interval": 1e-6}, "heartbeat_interval must be >= 0.1 seconds, got 1e-06"),
        ({"device_id": "0"}, "device_id must be a whole number (int), got '0' (str)"),
        ({"device_id": 1.0}, "device_id must be a whole number (int), got 1.0 (float)"),
        ({"device_id": -1}, "device_id must be >= 0, got -1"),
        ({"job_metadata": 5}, "job_metadata must be a string or None, got 5 (int)"),
        ({"scheduler": 5}, "scheduler must be a string or None, got 5 (int)"),
        ({"scheduler_args": []}, "scheduler_args must be a dict of argument names, got []"),
        ({"scheduler_args": {1: 2}}, "scheduler_args keys must be strings, got 1"),
        # Truthy strings meant True.
        ({"raise_on_job_error": "no"}, "raise_on_job_error must be True or False, got 'no'"),
        ({"instruction_energy": "yes"}, "instruction_energy must be True, False or None"),
        # A plain ValueError from the controller factory, after NVML was opened.
        ({"controller": "nvm"}, "controller must be 'nvml', 'dry-run', 'simulated' or an"),
        # Sent to the coordinator, which registered the job and then refused the rank.
        ({"pp_rank": 1}, "pp_rank=1 is out of range: pp_degree is 1 (0 to 0)"),
        ({"dp_rank": 2, "dp_degree": 2}, "dp_rank=2 is out of range: dp_degree is 2 (0 to 1)"),
        ({"tp_rank": 1}, "tp_rank=1 is out of range: tp_degree is 1 (0 to 0)"),
    ],
)
def test_a_bad_argument_is_named_before_anything_starts(
    gloo: None, r: redis.Redis, redis_url: str, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _hook(redis_url, **options)
    assert words in str(info.value)
    assert r.dbsize() == 0  # nothing was registered


def test_a_controller_that_is_no_controller_is_refused(gloo: None, redis_url: str) -> None:
    # Taken before: the job registered and trained, and close() failed ('int' has no 'stop').
    with pytest.raises(ConfigError, match=r"controller must be .* got 5 \(int\)"):
        _hook(redis_url, controller=5)


def test_redis_url_must_be_a_string(gloo: None, redis_url: str) -> None:
    # A TypeError from a regular expression, naming nothing.
    with pytest.raises(ConfigError, match=r"redis_url must be a string .* got 5 \(int\)"):
        _hook(5)


def test_zeus_server_url_keyword_is_refused_naming_redis_url(
    gloo: None, r: redis.Redis, redis_url: str
) -> None:
    # Zeus's keyword gave Python's bare "unexpected keyword argument 'server_url'".
    args: dict[str, Any] = {"server_url": "http://localhost:7787"}
    with pytest.raises(ConfigError) as info:
        PerseusOptimizer(  # type: ignore[call-arg]
            rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1, pp_degree=1,
            tp_degree=1, world_size=1, nvml_module=SIMULATED_NVML, **args,
        )  # fmt: skip
    words = str(info.value)
    assert "PerseusOptimizer" in words and "server_url" in words, words
    assert "redis_url" in words and "perseus coordinator" in words, words
    assert r.dbsize() == 0
    # Alongside redis_url too: Zeus's name is never taken unsaid.
    with pytest.raises(ConfigError, match="server_url"):
        _hook(redis_url, **args)
    assert r.dbsize() == 0
