"""The ranks' two scripts as Redis 7 functions, so that a rank's ACL user runs no Lua of its own.

A rank heartbeats and marks itself finished through Lua (:data:`store_scripts.HEARTBEAT`,
:data:`store_scripts.FINISH`). Run as scripts, they need EVALSHA and SCRIPT LOAD, and with
those a rank's user runs *any* Lua it sends: a loop that never ends (Redis then answers every
other client ``BUSY`` until someone runs SCRIPT KILL, which no perseus process does), a Lua heap
of gigabytes (``maxmemory`` does not count it), or an ``XADD ... MAXLEN 0`` that empties an
input stream named in ARGV. On Redis 7 a coordinator loads these bodies once as the function
library :data:`LIBRARY` (``FUNCTION LOAD REPLACE``, kept in RDB/AOF and replicated), and the
rank's ACL user may FCALL them but neither EVAL, EVALSHA nor SCRIPT (``protocol.acl``).
Functions run under the caller's ACL, like scripts: they can do nothing the rank could not.

Redis 6.2 has no functions: there :class:`RankScript` runs the same bodies as scripts, and a
rank's user keeps EVALSHA and SCRIPT LOAD (README "Who may do what").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script

from protocol.store_scripts import FINISH, HEARTBEAT

logger = logging.getLogger(__name__)

LIBRARY = "perseus_rank"
"""The function library's name (``FUNCTION LIST LIBRARYNAME perseus_rank``)."""
HEARTBEAT_FUNCTION = "perseus_heartbeat"
"""FCALL name of :data:`store_scripts.HEARTBEAT` (its KEYS and ARGV)."""
FINISH_FUNCTION = "perseus_finish"
"""FCALL name of :data:`store_scripts.FINISH` (its KEYS and ARGV)."""

# Scripts on 6.2 need it before TIME and writes; functions always replicate their effects,
# and do not have it.
_SCRIPT_ONLY = "redis.replicate_commands()"


def _function(name: str, body: str) -> str:
    if _SCRIPT_ONLY not in body:
        raise AssertionError(f"{name}: script body changed; check what the function drops")
    inner = body.replace(_SCRIPT_ONLY, "")
    return f"redis.register_function('{name}', function(KEYS, ARGV)\n{inner}\nend)\n"


def library_code() -> str:
    """The Lua source of :data:`LIBRARY` (FUNCTION LOAD)."""
    code = f"#!lua name={LIBRARY}\n"
    code += _function(HEARTBEAT_FUNCTION, HEARTBEAT)
    return code + _function(FINISH_FUNCTION, FINISH)


def install(conn: redis.Redis, redis_version: str) -> bool:
    """Load (or replace) the ranks' functions; return whether this server has functions.

    Called by each coordinator when it starts, and when it finds Redis emptied (a restart
    without persistence): ranks on Redis 7 whose user has no EVALSHA depend on them.

    Args:
        conn: A service user's connection (FUNCTION LOAD is a write).
        redis_version: The server's ``redis_version`` (INFO server).

    Raises:
        redis.RedisError: An outage, including a full Redis or a read-only replica; a Redis
            or user that refuses functions is only logged.
    """
    if int(redis_version.split(".")[0]) < 7:
        return False
    try:
        conn.function_load(library_code(), replace=True)
    except (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError):
        raise  # an outage (a full Redis, a replica mid-failover): the caller retries
    except redis.ResponseError as exc:
        # A server that refuses functions (a managed Redis, a user without @scripting): the
        # coordinator still serves; ranks whose user may run scripts fall back to them.
        logger.warning(
            "could not load the %s functions (%s): ranks heartbeat through scripts instead, "
            "which a rank's user on Redis 7 (perseus acl) may not run",
            LIBRARY,
            exc,
        )
        return False
    return True


class RankScript:
    """One of the ranks' Lua bodies: FCALL of its function, or EVALSHA where there is none.

    Tries the function first; a server without functions (Redis 6.2: unknown command) is
    remembered and gets the script from then on. A Redis 7 that does not have the library
    (no coordinator loaded it yet), or whose ACL refuses this user FCALL (a file written with
    ``--redis-major 6``, or by a perseus-mq from before the functions, which grants EVALSHA
    instead), gets the script for this call; a user that may run neither is told which.

    Args:
        conn: The caller's connection.
        function: The function's name in :data:`LIBRARY`.
        script: The same body as a script.
    """

    def __init__(self, conn: redis.Redis, function: str, script: str) -> None:
        self.conn = conn
        self.function = function
        self._script: Script = conn.register_script(script)
        self._functions = True

    def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run it with ``keys`` (KEYS) and ``args`` (ARGV); return its reply."""
        why_no_function = ""  # for a refusal of the script: why the function did not run
        if self._functions:
            try:
                return self.conn.fcall(self.function, len(keys), *keys, *args)
            except redis.exceptions.NoPermissionError as exc:
                # Not remembered: the user's rules may be fixed while it runs.
                why_no_function = (
                    f"nor FCALL its {LIBRARY} functions ({exc}): check this user's ACL rules "
                    "(`perseus acl`)"
                )
            except redis.ResponseError as exc:
                text = str(exc).lower()
                if "unknown command" in text:
                    self._functions = False
                elif "function not found" in text:
                    why_no_function = (
                        f"Redis has no {LIBRARY} functions, which a rank's user calls instead "
                        "of scripts: start a `perseus coordinator` on this Redis, it loads them"
                    )
                else:
                    raise
        try:
            return self._script(keys=list(keys), args=list(args))
        except redis.exceptions.NoPermissionError as exc:
            if not why_no_function:
                raise
            raise redis.exceptions.NoPermissionError(f"{exc} ({why_no_function})") from None
