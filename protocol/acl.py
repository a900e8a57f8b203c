"""Redis ACL users for the three roles that touch perseus-mq's keys: ranks, services, operators.

``perseus acl`` writes these rules as a Redis ACL file (``redis-server --aclfile FILE``). Each role
gets the commands and key patterns it needs and nothing else (README "Who may do what"):

* ``perseus-rank``: the training hook. Appends to the input streams, waits for its registration
  reply, follows a job's updates stream, reads schedules, refreshes the job's activity, and
  keeps power-limit profiles. It cannot read results, journals, the results' token keys or
  rq's state, delete anything, write a job's state or reach the dead-letter stream; on Redis 7
  it cannot read the input streams either. The activity and finish marks it writes for its
  own job it could write for any job (key patterns cannot tell jobs apart): the sweep deletes
  a job only on what ranks cannot forge (:meth:`protocol.store.JobStore.verified_activity`,
  :meth:`protocol.job_lifecycle.JobLifecycle.finish_proven`).
* ``perseus-service``: ``perseus coordinator`` and ``perseus worker`` (rq). Everything on the
  ``perseus:*`` and ``rq:*`` keys and rq's pubsub channels; no server administration.
* ``perseus-operator``: ``perseus status``, ``dump``, ``profile``, ``deadletter list``,
  ``power-limit show``: read only. Changing a running job (``perseus target``, ``deadletter
  replay``) is the service role's.

The ``default`` user is turned off, so a client without a user name gets nothing. It keeps
every permission all the same: Redis 7.0 replays the append-only file as that user, and one
without permissions has every MULTI/EXEC refused on reload (a restart lost the jobs).
"""

from __future__ import annotations

import hashlib

import redis

from protocol import keys
from protocol.exceptions import ConfigError

ROLES = ("rank", "service", "operator")

# Connection housekeeping. Not CLIENT SETINFO, which Redis 7.0 and older do not know (an ACL
# file naming it would not load); redis-py ignores its refusal on 7.2 and later.
_BASE = "+ping +auth +hello +client|setname +client|getname +client|id +client|info"

# Keys a rank reads but must not write: a job's version, schedules, info and updates stream,
# and the SHA-1 digests of its ranks' tokens (the heartbeat script, run as the rank, checks
# them). The results' HMAC keys (keys.job_tokens) match no rank pattern.
_RANK_READS = (
    keys.job_version("*"),
    keys.job_schedule("*", "*"),  # type: ignore[arg-type]
    keys.job_info("*"),
    keys.job_updates("*"),
    keys.job_beatcheck("*"),
)
# Streams a rank appends to but must not read: other ranks' registrations (request ids, whose
# replies carry tokens) and results.
_RANK_APPENDS = keys.INPUT_STREAMS
# Keys a rank writes: its reply list, the jobs index and its job's liveness hash (heartbeats:
# ZADD XX GT only refreshes existing jobs), its job's finished ranks and the finished jobs (the
# hook's close, through one script that checks the rank's token), power-limit profiles.
_RANK_WRITES = (
    keys.reply_key("*"),
    keys.JOBS_INDEX,
    keys.job_alive("*"),
    keys.job_finished("*"),
    keys.FINISHED_JOBS,
    keys.power_limit_profile("*"),
    keys.POWER_LIMIT_INDEX,
)
_RANK_COMMANDS = (
    "+xadd",  # registrations, results, targets
    "+blpop",  # its registration's reply (clients before the two below)
    "+brpoplpush +ltrim",  # its registration's reply, read without taking it, then removed
    "+xread",  # a job's updates stream
    "+get +hget +hgetall +hlen +exists",  # version, schedules, info (error), liveness
    "+time +zadd",  # heartbeats (one script or function), the server's clock
    "+sadd +scard",  # marking its rank finished at close (one script or function)
    "+multi +exec",  # saving a power-limit profile (SET + ZADD in MULTI)
)
# Redis 7: the heartbeat and finish run as functions a coordinator loads (rank_functions), and
# a rank may run no Lua of its own: with SCRIPT LOAD and EVALSHA it could loop for ever (every
# client gets BUSY), fill the Lua heap, or trim the input streams. Redis 6.2 has no functions.
_RANK_LUA_7 = "+fcall"
_RANK_LUA_6 = "+evalsha +script|load"
# SET replaces a key of any type: on Redis 7 a selector grants it for power-limit profiles
# only (a rank could otherwise wipe another job's heartbeats, or turn them into a string).
# Redis 6.2 has no selectors: there SET reaches every key a rank may write.
_RANK_SET_7 = f"(~{keys.power_limit_profile('*')} +set)"

_SERVICE = "~perseus:* ~rq:* &rq:* +@all -@admin -@dangerous +info +time"
_OPERATOR = "~perseus:* ~rq:* +@read -@dangerous +info +time"


def role_user(role: str) -> str:
    """The Redis user name of ``role``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    return f"perseus-{role}"


def role_rules(role: str, redis_major: int = 7) -> str:
    """The ACL rules (commands and key patterns) of ``role``, without its password.

    Args:
        role: One of :data:`ROLES`.
        redis_major: Redis 7 has read-only and write-only key patterns (``%R~``, ``%W~``):
            a rank can read but not write a job's schedules, and append to the input
            streams but not read them. Redis 6.2 has not; its rank rules let a rank's write
            commands (XADD, SET, ZADD) reach the keys it reads, and its XREAD the input
            streams.
    """
    if role == "rank":
        read, append = ("%R~", "%W~") if redis_major >= 7 else ("~", "~")
        patterns = [f"{read}{p}" for p in _RANK_READS]
        patterns += [f"{append}{p}" for p in _RANK_APPENDS] + [f"~{p}" for p in _RANK_WRITES]
        rules = f"{' '.join(patterns)} {_BASE} {' '.join(_RANK_COMMANDS)}"
        if redis_major >= 7:
            return f"{rules} {_RANK_LUA_7} {_RANK_SET_7}"
        return f"{rules} {_RANK_LUA_6} +set"
    if role == "service":
        return f"{_SERVICE} {_BASE}"
    if role == "operator":
        return f"{_OPERATOR} {_BASE}"
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def acl_file(passwords: dict[str, str], redis_major: int = 7) -> str:
    """A Redis ACL file with one user per role; passwords are stored as SHA-256 hashes.

    Args:
        passwords: Role -> password, for every role.
        redis_major: The server's major version (see :func:`role_rules`).

    Raises:
        ValueError: A role is missing or unknown, or a password is empty.
    """
    if set(passwords) != set(ROLES):
        raise ValueError(f"need a password for each of {', '.join(ROLES)}, got {sorted(passwords)}")
    # Off: nobody logs in as it. +@all: Redis 7.0 reloads the append-only file as this user.
    lines = ["user default off resetchannels ~* &* +@all"]
    for role in ROLES:
        if not passwords[role]:
            raise ValueError(f"the {role} password is empty")
        digest = hashlib.sha256(passwords[role].encode()).hexdigest()
        rules = role_rules(role, redis_major)
        lines.append(f"user {role_user(role)} on #{digest} resetchannels {rules}")
    return "\n".join(lines) + "\n"


def wrong_user(who: str, exc: Exception, role: str = "service") -> ConfigError:
    """The error of a process Redis refused a command (NOPERM) at its start: the wrong user.

    Waiting cannot fix that, unlike an outage: the process stops with this one line.

    Args:
        who: The process, e.g. ``"coordinator host-12"``.
        exc: Redis's refusal.
        role: The role whose user the process needs.
    """
    return ConfigError(
        f"{who}: Redis refused a command to this user (NOPERM: {exc}); it needs "
        f"{role_user(role)} (`perseus acl`)"
    )


# NOPERM inside a script (Redis 6.2: "The user executing the script can't run this command").
_NOPERM_MARKS = ("NOPERM", "no permissions", "can't run this")


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing this client (its login or an ACL), not an outage.

    A wrong user name or password, a disabled user, or a command or key the user's ACL rules
    do not grant: waiting for Redis does not cure any of them, its operator must.
    """
    if isinstance(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        return True
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return True
    return isinstance(exc, redis.ResponseError) and any(m in str(exc) for m in _NOPERM_MARKS)
