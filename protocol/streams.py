"""Input streams trimmed by what the coordinators acknowledged, and every lost entry counted.

Clients add entries without any MAXLEN: only the coordinator removes entries, and only those
its consumer group acknowledged (``XTRIM MINID`` below the oldest entry that is pending or not
yet delivered). A hard cap (``stream_hard_cap``) still bounds memory as a last resort. An entry
removed before it was acknowledged anyway (cut by the cap, trimmed while pending by someone
else, or a gap that Redis 7 reports through the group's lag) is counted in
:data:`protocol.keys.STREAM_LOSSES`, which ``perseus status`` shows.
Works on Redis 6.2 and 7; gaps made by others are seen on Redis 7 only (6.2 reports no lag).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis
from redis.client import Pipeline

from protocol import keys

_ID_HELPERS = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function after(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am > bm or (am == bm and as > bs)
end
local function next_id(id)
  local ms, seq = parse(id)
  return string.format('%d-%d', ms, seq + 1)
end
local function field(list, name)
  for i = 1, #list, 2 do
    if list[i] == name then return list[i + 1] end
  end
  return nil
end
"""

# Claim entries pending with any consumer for longer than an idle time, and tell which of
# them are gone. JUSTID then XRANGE, because Redis 6.2 answers a plain XAUTOCLAIM of a trimmed
# entry with a bare nil (no id to acknowledge it by); Redis 7 lists deleted ids itself, and
# drops them from the pending list: they are counted here, in the same script.
# KEYS[1] input stream, KEYS[2] losses hash.
# ARGV[1] consumer group, ARGV[2] consumer, ARGV[3] min idle ms, ARGV[4] count.
# Returns {{id, {field, value, ...}}, ...} claimed entries still there, {ids claimed but gone
# (6.2: still pending, now with this consumer)}, {ids Redis 7 removed from the pending list
# (counted)}.
CLAIM = (
    _ID_HELPERS
    + """
redis.replicate_commands()  -- Redis 6.2: writes after non-deterministic commands
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0',
                    'COUNT', ARGV[4], 'JUSTID')
local live, gone = {}, {}
for _, id in ipairs(r[2]) do
  local rows = redis.call('XRANGE', KEYS[1], id, id)
  if #rows == 0 then gone[#gone + 1] = id else live[#live + 1] = rows[1] end
end
local deleted = r[3] or {}
if #deleted > 0 then redis.call('HINCRBY', KEYS[2], KEYS[1], #deleted) end
return {live, gone, deleted}
"""
)

# Trim one input stream by acknowledgement, then enforce the hard cap, counting what is lost.
# KEYS[1] input stream, KEYS[2] losses hash.
# ARGV[1] consumer group, ARGV[2] hard cap (entries), ARGV[3] most entries one call reads
# (cut for the cap, or counted for the gap check).
# Returns {acknowledged entries trimmed, {ids of unread entries the cap cut}, entries of a gap
# found now (Redis 7 only), the group's last-delivered id ('' without a group)}.
TRIM = (
    _ID_HELPERS
    + """
redis.replicate_commands()  -- Redis 6.2: writes after non-deterministic commands
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, {}, 0, ''} end
local group = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  if field(g, 'name') == ARGV[1] then group = g end
end
if not group then return {0, {}, 0, ''} end
local last = field(group, 'last-delivered-id')
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
-- Below the oldest pending entry, or (nothing pending) up to the last delivered one, every
-- entry was delivered and acknowledged.
local floor = next_id(last)
if pending[1] > 0 then floor = pending[2] end
local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', floor)
-- Redis 7: the lag counts entries added but never delivered, including removed ones; more
-- lag than undelivered entries present is a gap. A group that never read has no count of
-- entries read: then every entry added and gone is one. The mark keeps a gap from counting
-- twice. (Redis 6.2 has neither field: lag stays nil.)
local lag = field(group, 'lag')
local never_read = field(group, 'entries-read') == false and last == '0-0'
if never_read then
  lag = field(redis.call('XINFO', 'STREAM', KEYS[1]), 'entries-added')
end
local mark_field = 'gapmark:' .. KEYS[1]
local gap = 0
if lag then
  local excess = 0
  if never_read then
    excess = lag - redis.call('XLEN', KEYS[1])
  elseif lag > 0 then
    -- Entries delivered but kept (a pending one holds back those after it): a short range,
    -- unless a pending entry is stuck; then skip the check this round (excess = nil).
    local delivered = #redis.call('XRANGE', KEYS[1], floor, last, 'COUNT', ARGV[3] + 1)
    excess = nil
    if delivered <= tonumber(ARGV[3]) then
      excess = lag - (redis.call('XLEN', KEYS[1]) - delivered)
    end
  end
  local mark = tonumber(redis.call('HGET', KEYS[2], mark_field) or '0')
  if excess ~= nil then
    if excess > mark then
      gap = excess - mark
      redis.call('HINCRBY', KEYS[2], KEYS[1], gap)
    end
    if excess ~= mark then redis.call('HSET', KEYS[2], mark_field, excess) end
  end
end
local lost = {}
local over = redis.call('XLEN', KEYS[1]) - tonumber(ARGV[2])
if over > 0 then
  local rows = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', math.min(over, tonumber(ARGV[3])))
  for _, row in ipairs(rows) do
    if after(row[1], last) then lost[#lost + 1] = row[1] end
  end
  redis.call('XTRIM', KEYS[1], 'MINID', next_id(rows[#rows][1]))
  if #lost > 0 then
    redis.call('HINCRBY', KEYS[2], KEYS[1], #lost)
    if lag then redis.call('HINCRBY', KEYS[2], mark_field, #lost) end
  end
end
return {trimmed, lost, gap, last}
"""
)

CAP_BATCH = 10_000
"""Most entries one TRIM call cuts for the hard cap (bounds the script's time in Redis)."""


@dataclass
class Claimed:
    """What :func:`claim_stale` took over: entries to process and ids that are gone."""

    entries: list[tuple[str, dict[bytes, bytes]]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # pending (6.2): count and acknowledge them
    deleted: list[str] = field(default_factory=list)  # Redis 7 dropped them; counted already


@dataclass
class Trimmed:
    """What :func:`trim_acknowledged` did to one stream."""

    stream: str
    trimmed: int  # acknowledged entries removed
    cut: list[str]  # ids of unread entries the hard cap removed (counted as lost)
    gap: int  # unread entries found missing (Redis 7), counted as lost
    last_delivered: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def claim_stale(
    conn: redis.Redis, stream: str, group: str, consumer: str, min_idle_ms: int, count: int = 100
) -> Claimed:
    """Claim entries pending with any consumer for over ``min_idle_ms`` (one page)."""
    script = conn.register_script(CLAIM)
    live, gone, deleted = script(
        keys=[stream, keys.STREAM_LOSSES], args=[group, consumer, min_idle_ms, count]
    )
    claimed = Claimed(gone=[_text(i) for i in gone], deleted=[_text(i) for i in deleted])
    for entry_id, flat in live:
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        claimed.entries.append((_text(entry_id), fields))
    return claimed


def trim_acknowledged(
    conn: redis.Redis, stream: str, group: str, hard_cap: int, cap_batch: int = CAP_BATCH
) -> Trimmed:
    """Remove ``stream``'s acknowledged entries, then enforce ``hard_cap`` (see module doc)."""
    script = conn.register_script(TRIM)
    trimmed, cut, gap, last = script(
        keys=[stream, keys.STREAM_LOSSES], args=[group, hard_cap, cap_batch]
    )
    return Trimmed(stream, int(trimmed), [_text(i) for i in cut], int(gap), _text(last))


def count_lost(
    conn: redis.Redis | Pipeline, stream: str, how_many: int, pipeline: Pipeline | None = None
) -> None:
    """Add ``how_many`` entries lost from ``stream`` to the losses hash."""
    (pipeline or conn).hincrby(keys.STREAM_LOSSES, stream, how_many)


def lost_counts(conn: redis.Redis) -> dict[str, int]:
    """Entries lost so far, per input stream and for dead letters (0 for none lost)."""
    names = [*keys.INPUT_STREAMS, keys.DEADLETTER_STREAM]
    raw = conn.hmget(keys.STREAM_LOSSES, names)
    return {s: int(v or 0) for s, v in zip(names, raw, strict=True)}


def cap_dead_letters(conn: redis.Redis, hard_cap: int) -> tuple[int, str]:
    """Remove the oldest dead letters beyond ``hard_cap``; count them as lost.

    Dead letters wait for a person (replay or purge): nothing else ever removes one, so this
    cap is all that bounds the stream when bad entries keep coming.

    Returns:
        How many were removed, and the id of the newest removed ('' if none).
    """
    excess = int(conn.xlen(keys.DEADLETTER_STREAM)) - hard_cap
    if excess <= 0:
        return 0, ""
    doomed = conn.xrange(keys.DEADLETTER_STREAM, count=excess)
    ids = [entry_id for entry_id, _ in doomed]
    with conn.pipeline(transaction=True) as pipe:
        pipe.xdel(keys.DEADLETTER_STREAM, *ids)
        count_lost(conn, keys.DEADLETTER_STREAM, len(ids), pipeline=pipe)
        pipe.execute()
    return len(ids), ids[-1].decode()
