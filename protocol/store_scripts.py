"""The Lua scripts behind :class:`protocol.store.JobStore`: each multi-key update runs atomically.

Key names come from the caller (built in :mod:`protocol.keys`); every script documents its
KEYS and ARGV. Status codes below zero tell the store which error to raise.
"""

from __future__ import annotations

import redis
from redis.commands.core import Script

# KEYS[1] job info, KEYS[2] jobs index, KEYS[3] starting jobs (collected sooner if no version
# comes); optionally KEYS[4] the request's key (-> job id), and with it optionally KEYS[5] reply
# list, KEYS[6] the registration's source stream.
# ARGV[1] job id, ARGV[2] now, ARGV[3] registration entry id, ARGV[4] request key TTL (s),
# ARGV[5] msgpack reply, ARGV[6] reply TTL, ARGV[7] consumer group, ARGV[8] source entry id
# (ARGV[5..8] are read with KEYS[5..6] only, and are '' without them), ARGV[9..] info field,
# value pairs.
# With KEYS[5..6], a job created is also answered (its reply pushed) and its entry
# acknowledged, so a registration is answered in the same round trip; other outcomes leave
# both to the caller.
# Returns {1, entry id} when created, {0, owner entry id} when the job exists, {2, job id}
# when the same request created that job before and it still exists (a client's retry).
CREATE_JOB = """
if KEYS[4] then
  local earlier = redis.call('GET', KEYS[4])
  if earlier and redis.call('ZSCORE', KEYS[2], earlier) then return {2, earlier} end
end
local existing = redis.call('HGET', KEYS[1], 'entry_id')
if existing then return {0, existing} end
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
if KEYS[4] then redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[4]) end
if KEYS[6] then
  redis.call('LPUSH', KEYS[5], ARGV[5])
  redis.call('EXPIRE', KEYS[5], ARGV[6])
  redis.call('XACK', KEYS[6], ARGV[7], ARGV[8])
end
return {1, ARGV[3]}
"""

# KEYS[1] job info, KEYS[2] job ranks, KEYS[3] jobs index, KEYS[4] due set, KEYS[5] job
# tokens, KEYS[6] job beatcheck; optionally KEYS[7] reply list, KEYS[8] the registration's
# source stream.
# ARGV[1] job id, ARGV[2] now, ARGV[3] rank, ARGV[4] msgpack RankInfo, ARGV[5] world size,
# ARGV[6] SHA-256 of the rank's new token (64 hex), ARGV[7] its SHA-1, ARGV[8] request id,
# ARGV[9] '1' to stamp the job's activity (jobs index, and 'active_at' of the job info, which
# only services write) ('0': it was, a moment ago);
# with KEYS[7..8]: ARGV[10] msgpack reply (carries the token), ARGV[11] reply TTL, ARGV[12]
# consumer group, ARGV[13] source entry id: on success the reply is pushed and the entry
# acknowledged too, so a registration is answered in the same round trip.
# A rank registers once per job: the token of its first registration stays. The same request
# delivered again is acknowledged without a second reply (the first one holds the token).
# Returns {status, ranks registered}: 1 ok, -1 unknown job, -2 rank registered with other info,
# -6 rank registered by another request, -7 this very request was already answered.
ADD_RANK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
if redis.call('HSETNX', KEYS[2], ARGV[3], ARGV[4]) == 0 then
  if redis.call('HGET', KEYS[2], ARGV[3]) ~= ARGV[4] then return {-2, 0} end
  local owner = redis.call('HGET', KEYS[5], ARGV[3]) or ''
  if string.sub(owner, 65) ~= ARGV[8] then return {-6, 0} end
  if KEYS[8] then redis.call('XACK', KEYS[8], ARGV[12], ARGV[13]) end
  return {-7, redis.call('HLEN', KEYS[2])}
end
redis.call('HSET', KEYS[5], ARGV[3], ARGV[6] .. ARGV[8])
redis.call('HSET', KEYS[6], ARGV[3], ARGV[7])
if ARGV[9] == '1' then
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
  redis.call('HSET', KEYS[1], 'active_at', ARGV[2])
end
local count = redis.call('HLEN', KEYS[2])
if count >= tonumber(ARGV[5]) then redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1]) end
if KEYS[8] then
  redis.call('LPUSH', KEYS[7], ARGV[10])
  redis.call('EXPIRE', KEYS[7], ARGV[11])
  redis.call('XACK', KEYS[8], ARGV[12], ARGV[13])
end
return {1, count}
"""

# Several ranks' results of one version of one job (a batch of stream entries).
# KEYS[1] job info, KEYS[2] job ranks, KEYS[3] job version, KEYS[4] results of the version,
# KEYS[5] jobs index, KEYS[6] due set; optionally KEYS[7] the results' source stream.
# ARGV[1] job id, ARGV[2] now, ARGV[3] the version, ARGV[4] world size, ARGV[5] consumer group
# (with KEYS[7]; else ''), ARGV[6] the rq task enqueued to advance the job ('' none),
# ARGV[7..] rank, msgpack ProfilingResult, source entry id ('' none) triples.
# Stamps the job's activity (jobs index, 'active_at' of the job info). With KEYS[7], the source
# entries of results stored (1) or there already (0) are acknowledged, so a batch needs no
# transaction of its own for that; refused ones are left to the caller (dead letters). A version
# completed by these results is recorded as due, with ARGV[6] as the task that advances it
# ('rq_job', 'enqueued_at' of the job info).
# Returns {status, latest version, results of the version, then per triple: 1 added, 0 already
# there (the same bytes: a redelivered entry), -8 a different result of the rank is there (the
# first one stays), -3 rank not registered}; status 1 ok, -1 unknown job, -4 version not
# published, -5 version already consumed (its results expired after a snapshot).
ADD_RESULTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0, 0} end
local latest = tonumber(redis.call('GET', KEYS[3]) or '0')
local version = tonumber(ARGV[3])
if version < 1 or version > latest then return {-4, latest, 0} end
local floor = tonumber(redis.call('HGET', KEYS[1], 'results_floor') or '1')
if version < floor then return {-5, latest, 0} end
local out = {1, latest, 0}
-- Two HMGETs and one HSET for the whole batch, not a call or two per result: a quarter less
-- Redis time (64 results of 1.8 kB: 110-136 us, not 148-168). A thousand ranks at a time:
-- Lua's unpack takes at most about 8000 values.
local n = (#ARGV - 6) / 3
local ranks, registered, stored = {}, {}, {}
for j = 1, n do ranks[j] = ARGV[4 + 3 * j] end
for first = 1, n, 1000 do
  local last = math.min(first + 999, n)
  local known = redis.call('HMGET', KEYS[2], unpack(ranks, first, last))
  local there = redis.call('HMGET', KEYS[4], unpack(ranks, first, last))
  for k = 1, last - first + 1 do
    registered[first + k - 1] = known[k]
    stored[first + k - 1] = there[k]
  end
end
local new, taken, acked = {}, {}, {}
for j = 1, n do
  local rank, data, entry = ranks[j], ARGV[5 + 3 * j], ARGV[6 + 3 * j]
  local current = taken[rank] or stored[j]  -- a rank twice in one batch: the first stays
  local added = -8
  if not registered[j] then
    added = -3
  elseif not current then
    taken[rank] = data
    new[#new + 1] = rank
    new[#new + 1] = data
    added = 1
  elseif current == data then
    added = 0
  end
  out[#out + 1] = added
  if added >= 0 and entry ~= '' then acked[#acked + 1] = entry end
end
for first = 1, #new, 1000 do
  redis.call('HSET', KEYS[4], unpack(new, first, math.min(first + 999, #new)))
end
if KEYS[7] then
  for first = 1, #acked, 1000 do
    redis.call('XACK', KEYS[7], ARGV[5], unpack(acked, first, math.min(first + 999, #acked)))
  end
end
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[1], 'active_at', ARGV[2])
local count = redis.call('HLEN', KEYS[4])
out[3] = count
if version == latest and count >= tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[1], 'complete', ARGV[3])
  redis.call('ZADD', KEYS[6], ARGV[2], ARGV[1])
  if ARGV[6] ~= '' then
    redis.call('HSET', KEYS[1], 'enqueued_at', string.format('%.3f', ARGV[2]), 'rq_job', ARGV[6])
  end
end
return out
"""

# KEYS[1] job info, KEYS[2] job control stream, KEYS[3] jobs index, KEYS[4] due set.
# ARGV[1] source entry id, ARGV[2] msgpack SetTarget, ARGV[3] job id, ARGV[4] now.
# Appended: the job's activity stamped (jobs index, 'active_at' of the job info), due marked.
# Returns 1 appended, 0 already there (a redelivered entry), -1 unknown job, -2 older than a
# message already applied (one left pending, then claimed after a newer one was handled): not
# appended, since the job's control stream keeps its source ids in order.
ADD_CONTROL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local added = redis.pcall('XADD', KEYS[2], ARGV[1], 'data', ARGV[2])
if type(added) == 'table' and added.err then
  if not string.find(added.err, 'equal or smaller') then return redis.error_reply(added.err) end
  if #redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1]) == 0 then return -2 end
  return 0
end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[3])
redis.call('HSET', KEYS[1], 'active_at', ARGV[4])
return 1
"""

# Compare-and-set on the version number: exactly one writer publishes each version, so no
# version is skipped or published twice even when two workers compute it concurrently.
# KEYS[1] job version, KEYS[2] schedule of the new version, KEYS[3] journal, KEYS[4] updates
# stream, KEYS[5] jobs index, KEYS[6] job info, KEYS[7] summaries, KEYS[8] an old schedule.
# ARGV[1] job id, ARGV[2] now, ARGV[3] expected current version, ARGV[4] new version,
# ARGV[5] msgpack JournalEntry, ARGV[6] updates MAXLEN, ARGV[7] expected journal length ('':
# any), ARGV[8] summary field ('' none), ARGV[9] summary, ARGV[10] '1' deletes KEYS[8],
# ARGV[11..] rank, msgpack FrequencySchedule pairs; or, for a wide version, none of them and
# KEYS[9], the draft hash that holds them (written in chunks before: one call with 100,000
# ranks' schedules blocked Redis for 316 ms), renamed to KEYS[2] or deleted.
# Returns {1, new version}, {0, current version}, {-1, 0}: the job is gone (deleted while its
# version was computed; writing would leave a partial job behind), or {-2, current version}:
# the draft is gone (it expired). A failure recorded before is over: cleared, and the
# announcement says so (error='') to the ranks' watchers.
PUBLISH = """
local function drop(status, current)
  if KEYS[9] then redis.call('DEL', KEYS[9]) end
  return {status, current}
end
if redis.call('EXISTS', KEYS[6]) == 0 then return drop(-1, 0) end
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current ~= tonumber(ARGV[3]) then return drop(0, current) end
if ARGV[7] ~= '' and redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[7]) then
  return drop(0, current)
end
if KEYS[9] then
  if redis.call('EXISTS', KEYS[9]) == 0 then return {-2, current} end
  redis.call('RENAME', KEYS[9], KEYS[2])
  redis.call('PERSIST', KEYS[2])
end
-- A thousand values at a time: Lua's unpack takes at most about 8000 (4000 ranks).
for i = 11, #ARGV, 1000 do
  redis.call('HSET', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('SET', KEYS[1], ARGV[4])
redis.call('RPUSH', KEYS[3], ARGV[5])
local failed = redis.call('HGET', KEYS[6], 'error')
if failed and failed ~= '' then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'version', ARGV[4], 'error', '')
else
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'version', ARGV[4])
end
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[6], 'published_at', ARGV[2], 'error', '')
if ARGV[8] ~= '' then redis.call('HSET', KEYS[7], ARGV[8], ARGV[9]) end
if ARGV[10] == '1' then redis.call('DEL', KEYS[8]) end
return {1, tonumber(ARGV[4])}
"""

# An observation that produced no new version: appended only if nobody appended meanwhile.
# KEYS[1] journal, KEYS[2] jobs index, KEYS[3] summaries, KEYS[4] job info, KEYS[5] updates
# stream. ARGV[1] expected journal length, ARGV[2] msgpack JournalEntry, ARGV[3] now, ARGV[4]
# job id, ARGV[5] summary field ('' none), ARGV[6] summary, ARGV[7] updates MAXLEN. Returns 1
# appended, 0 not, -1 the job is gone. The scheduler computed: a failure recorded before is
# over, cleared and announced (error='') to the ranks' watchers, as PUBLISH does.
RECORD = """
if redis.call('EXISTS', KEYS[4]) == 0 then return -1 end
if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[2])
local failed = redis.call('HGET', KEYS[4], 'error')
if failed and failed ~= '' then
  redis.call('HSET', KEYS[4], 'error', '')
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[7], '*', 'error', '')
end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], ARGV[6]) end
return 1
"""

# Stores a scheduler snapshot taken after the first ARGV[1] journal entries, and deletes the
# results those entries consumed; only if the journal still has exactly that many entries and
# no newer snapshot exists.
# KEYS[1] snapshot, KEYS[2] journal, KEYS[3] job info, KEYS[4..] results hashes to delete.
# ARGV[1] journal length covered, ARGV[2] msgpack snapshot, ARGV[3] new results floor (results
# of lower versions are refused from now on). Returns 1 stored, 0 not (the job gone included).
SNAPSHOT = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[1]) then return 0 end
if tonumber(redis.call('HGET', KEYS[3], 'snapshot_len') or '0') >= tonumber(ARGV[1]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[3], 'snapshot_len', ARGV[1], 'results_floor', ARGV[3])
for i = 4, #KEYS, 1000 do redis.call('DEL', unpack(KEYS, i, math.min(i + 999, #KEYS))) end
return 1
"""

# Whether a job needs its next version computed: all ranks registered, and no version yet, or
# the latest version's results complete but not observed by the journal's last entry, or
# control messages it has not applied; a finished job has nothing due. ARGV[2] == 'settle': a
# job with nothing due leaves the due set; 'mark': a due job joins it (if absent, at ARGV[3]).
# KEYS[1] job info, KEYS[2] job ranks, KEYS[3] job version, KEYS[4] journal, KEYS[5] job
# control stream, KEYS[6] due set, KEYS[7] finished jobs. ARGV[1] job id, ARGV[2] '', 'settle'
# or 'mark', ARGV[3] now. Returns 1 due, 0 not, -1 unknown job.
DUE = """
local f = redis.call('HMGET', KEYS[1], 'world_size', 'complete')
if not f[1] then
  if ARGV[2] == 'settle' then redis.call('ZREM', KEYS[6], ARGV[1]) end
  return -1
end
local due = 0
if redis.call('HLEN', KEYS[2]) >= tonumber(f[1]) then
  local latest = tonumber(redis.call('GET', KEYS[3]) or '0')
  local raw = redis.call('LINDEX', KEYS[4], -1)
  local tail = {}
  if raw then tail = cmsgpack.unpack(raw) end
  if latest == 0 then
    due = 1
  elseif tonumber(f[2] or '0') == latest and tail['observed_version'] ~= latest then
    due = 1
  elseif redis.call('XLEN', KEYS[5]) > (tail['controls_upto'] or 0) then
    due = 1
  end
end
if due == 1 and redis.call('ZSCORE', KEYS[7], ARGV[1]) then due = 0 end
if due == 0 and ARGV[2] == 'settle' then redis.call('ZREM', KEYS[6], ARGV[1]) end
if due == 1 and ARGV[2] == 'mark' then redis.call('ZADD', KEYS[6], 'NX', ARGV[3], ARGV[1]) end
return due
"""

# Deletes a job's keys, but only if it is still idle: a heartbeat may have come in since the
# sweep listed it. KEYS[1] jobs index, KEYS[2] due set, KEYS[3] finished jobs, KEYS[4] starting
# jobs, KEYS[5] job version, KEYS[6..] the job's other keys (schedules and results of versions
# 1..ARGV[3]). ARGV[1] job id, ARGV[2] idle cutoff ('' deletes unconditionally), ARGV[3] the
# version key's value the caller listed keys for, as read ('0' if absent, '?' if not a string:
# compared as it is, so a version key someone replaced with garbage is deleted too).
# Returns 1 deleted, 0 not (active), -1 the version changed (list its keys and call again).
# DEL takes the keys 1000 at a time: Lua's unpack fails past about 8000 values.
DELETE_JOB = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ARGV[2] ~= '' and score and tonumber(score) > tonumber(ARGV[2]) then return 0 end
local version = redis.pcall('GET', KEYS[5])
if type(version) == 'table' then version = '?' end
if (version or '0') ~= ARGV[3] then return -1 end
for i = 1, 4 do redis.call('ZREM', KEYS[i], ARGV[1]) end
for i = 5, #KEYS, 1000 do redis.call('DEL', unpack(KEYS, i, math.min(i + 999, #KEYS))) end
return 1
"""

# KEYS[1] lease. ARGV[1] holder token. Returns 1 released, 0 held by another (or expired).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] lease. ARGV[1] holder token, ARGV[2] new TTL in ms. Returns 1 renewed, 0 lost.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


# A rank's heartbeat (on Redis 7 a function, protocol.rank_functions: ranks may not EVALSHA),
# timed by the Redis server's clock, so that ranks and coordinators whose
# clocks disagree still agree on how long ago a rank was heard from. Run by the ranks' ACL user,
# so it can read the token digests of the beatcheck hash only (never the results' HMAC keys).
# The job info and beatcheck are only read, and named in ARGV: Redis 7 lets a script declare a
# key (KEYS) only to a user who may write it, and ranks may only read these two.
# KEYS[1] jobs index, KEYS[2] job alive set ('<rank>:<proof>' -> time).
# ARGV[1] job id, ARGV[2] rank, ARGV[3] the rank's token, ARGV[4] its alive proof
# (protocol.tokens.alive_proof; the sweep checks it, this script cannot), ARGV[5] job info key,
# ARGV[6] job beatcheck key.
# Returns 1 if the job exists (refreshed only then: a deleted job is never revived), 0 if not,
# -1 if the token is not the rank's (nothing refreshed: it does not count as liveness).
HEARTBEAT = """
if redis.call('EXISTS', ARGV[5]) == 0 then return 0 end
local digest = redis.call('HGET', ARGV[6], ARGV[2])
if not digest or digest ~= redis.sha1hex(ARGV[3]) then return -1 end
redis.replicate_commands()  -- Redis 6.2: TIME before writes needs effects replication
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('ZADD', KEYS[1], 'XX', 'GT', now, ARGV[1])
redis.call('ZADD', KEYS[2], now, ARGV[2] .. ':' .. ARGV[4])
return 1
"""


# Marks a rank (or, with ARGV[2] == '', the whole job) finished, on the server's clock (on
# Redis 7 a function, protocol.rank_functions, like the heartbeat).
# Idempotent: a rank marked twice counts once, and a finished job keeps its first finish time.
# A rank proves itself with its token, like a heartbeat: runs as the rank's ACL user, so it
# compares SHA-1 digests (the beatcheck hash); its mark carries its alive proof, which the
# sweep checks (every rank can write the finished sets directly). An operator finishing the
# whole job passes no token and is recorded on the job info first: a rank's ACL user may not
# write that, so a rank cannot take this path (nothing is written before the refusal).
# The job info and beatcheck are named in ARGV, as in the heartbeat script above:
# Redis 7 lets a script declare (KEYS) only keys its user may write.
# KEYS[1] job's finished ranks ('<rank>:<proof>'), KEYS[2] finished jobs.
# ARGV[1] job id, ARGV[2] rank ('' finishes the job whatever its ranks did), ARGV[3] the rank's
# token, ARGV[4] its alive proof (both ignored with ARGV[2] == ''), ARGV[5] job info key,
# ARGV[6] job beatcheck key.
# Returns {status, ranks finished, world size}: 0 unknown job, -1 rank out of range, -2 wrong
# token, 1 recorded, 2 recorded and the job is finished.
FINISH = """
if redis.call('EXISTS', ARGV[5]) == 0 then return {0, 0, 0} end
local world = tonumber(redis.call('HGET', ARGV[5], 'world_size'))
if ARGV[2] ~= '' then
  local rank = tonumber(ARGV[2])
  if not rank or rank < 0 or rank >= world or rank % 1 ~= 0 then return {-1, 0, world} end
  local digest = redis.call('HGET', ARGV[6], ARGV[2])
  if not digest or digest ~= redis.sha1hex(ARGV[3]) then return {-2, 0, world} end
else
  redis.call('HSET', ARGV[5], 'finished_by', 'operator')
end
redis.replicate_commands()  -- Redis 6.2: TIME before writes needs effects replication
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
if ARGV[2] ~= '' then redis.call('SADD', KEYS[1], ARGV[2] .. ':' .. ARGV[4]) end
local count = redis.call('SCARD', KEYS[1])
if ARGV[2] == '' or count >= world then
  redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1])
  return {2, count, world}
end
return {1, count, world}
"""


# Writes to a hash of a job only while the job exists: a write racing the job's deletion must
# not leave a partial job (an info hash without its degrees) or a stray key behind. Sent with
# EVAL (short, and usable inside a caller's transaction with no NOSCRIPT to handle).
# KEYS[1] job info, KEYS[2] the hash written (KEYS[1] itself, or another of the job's hashes).
# ARGV field, value pairs. Returns 1 written, 0 the job does not exist.
# A thousand values at a time: Lua's unpack takes at most about 8000 (a scheduler's artifacts
# are as many as it likes).
HSET_IF_JOB = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 1, #ARGV, 1000 do
  redis.call('HSET', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
return 1
"""

# A scheduler failure, recorded on the job and announced on its updates stream (every rank's
# watcher follows it), if the job still exists. Sent with EVAL, like HSET_IF_JOB.
# KEYS[1] job info, KEYS[2] job updates stream. ARGV[1] the error, ARGV[2] updates MAXLEN.
# Returns 1 recorded, 0 the job does not exist.
FAIL_JOB = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'error', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'error', ARGV[1])
return 1
"""


class Scripts:
    """Every script above, registered on one client (EVALSHA, loaded again when missing)."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self.create_job: Script = conn.register_script(CREATE_JOB)
        self.add_rank: Script = conn.register_script(ADD_RANK)
        self.add_results: Script = conn.register_script(ADD_RESULTS)
        self.add_control: Script = conn.register_script(ADD_CONTROL)
        self.publish: Script = conn.register_script(PUBLISH)
        self.record: Script = conn.register_script(RECORD)
        self.snapshot: Script = conn.register_script(SNAPSHOT)
        self.due: Script = conn.register_script(DUE)
        self.delete_job: Script = conn.register_script(DELETE_JOB)
        self.release: Script = conn.register_script(RELEASE)
        self.renew: Script = conn.register_script(RENEW)
