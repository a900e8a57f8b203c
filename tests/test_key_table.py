"""Every Redis key and stream name built in protocol/keys.py is documented in the README."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from protocol import keys

README = Path(__file__).resolve().parent.parent / "README.md"
# How the README's key table writes each placeholder.
PLACEHOLDERS = {
    "job_id": "<id>",
    "plan_id": "<id>",
    "version": "<v>",
    "request_id": "<request_id>",
    "workload": "<workload>",
    "nonce": "<nonce>",
}
# Prefixes that name a family of keys, not a key.
BASES = {"job_key"}


def documented() -> set[str]:
    """Names in the first column of the README's "Redis key layout" table."""
    text = README.read_text()
    table = text.split("## Redis key layout", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| (?:group )?`([^`]+)`", table, flags=re.M))


def built() -> dict[str, str]:
    """Python name -> the key it builds, placeholders as the README writes them."""
    names = {}
    for name, value in vars(keys).items():
        if name.isupper() and isinstance(value, str) and name != "PREFIX":
            names[name] = value
    for name, fn in inspect.getmembers(keys, inspect.isfunction):
        if fn.__module__ != keys.__name__ or name in BASES:
            continue
        params = inspect.signature(fn).parameters.values()
        args = [PLACEHOLDERS[p.name] for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        names[f"{name}()"] = fn(*args)
    return names


def test_every_key_built_in_protocol_keys_is_in_the_readme_table():
    table = documented()
    assert len(table) > 20, "the README's key table was not found"
    # rq's queue and jobs are documented under rq's own key names.
    known = table | {n.split(":", 2)[2] for n in table if n.startswith(("rq:queue:", "rq:job:"))}
    missing = {py: key for py, key in built().items() if key not in known}
    assert not missing, f"README.md 'Redis key layout' lacks: {missing}"


def test_every_key_in_the_readme_table_is_built_in_protocol_keys():
    # The other way round: a row for a key that no code builds (renamed, or never written)
    # sends an operator's redis-cli to a name that is not there.
    values = set(built().values())
    # rq stores the queue and a planner run's job under its own prefixes.
    values |= {f"rq:queue:{keys.RQ_QUEUE}", f"rq:job:{keys.plan_rq_job('<id>')}"}
    stale = sorted(documented() - values)
    assert not stale, f"README.md 'Redis key layout' documents keys nobody builds: {stale}"
