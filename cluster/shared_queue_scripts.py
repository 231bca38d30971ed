"""The shared fair queue's Lua scripts (``cluster.shared_queue``): each runs atomically in
Redis, so two ingresses never both take the last slot or release out of order.

Keys, under the namespace ``ns`` (ARGV[1] of every script): ``ns:st`` (hash: ``V``, the
start tag of the request released last; ``F:<tenant>``, each tenant's last finish tag),
``ns:wait`` (sorted set, all scores 0, ordered by member: ``<9 - priority>:<start tag,
zero-padded>:<arrival, zero-padded>``, so the first member is the next to go), ``ns:wm``
(hash: member -> ``<ingress> <count>``), ``ns:inf`` (hash: ingress -> its requests in the
engines), ``ns:alive:<ingress>`` (expires unless the ingress renews it) and ``ns:rel:<ingress>``
(the channel where an ingress hears which of its waiters were released). An ingress whose
``alive`` key expired is dropped: its requests stop counting and its waiters are removed.
"""

from __future__ import annotations

# release(ns, cap): every head that fits goes, in order; returns the members released
_COMMON = """
local function live_in_flight(ns)
  local t = redis.call('HGETALL', ns .. ':inf')
  local total = 0
  for i = 1, #t, 2 do
    if redis.call('EXISTS', ns .. ':alive:' .. t[i]) == 1 then
      total = total + tonumber(t[i + 1])
    else
      redis.call('HDEL', ns .. ':inf', t[i])
    end
  end
  return total
end
local function release(ns, cap)
  local total = live_in_flight(ns)
  local released = {}
  while true do
    local head = redis.call('ZRANGE', ns .. ':wait', 0, 0)
    if #head == 0 then break end
    local m = head[1]
    local owner = redis.call('HGET', ns .. ':wm', m) or ''
    local ingress, count = string.match(owner, '^(%S+) (%d+)$')
    count = tonumber(count) or 1
    if ingress ~= nil and redis.call('EXISTS', ns .. ':alive:' .. ingress) == 0 then
      ingress = nil
    end
    if ingress ~= nil and total > 0 and total + count > cap then break end
    redis.call('ZREM', ns .. ':wait', m)
    redis.call('HDEL', ns .. ':wm', m)
    if ingress ~= nil then
      redis.call('HINCRBY', ns .. ':inf', ingress, count)
      total = total + count
      redis.call('HSET', ns .. ':st', 'V', string.match(m, '^%d:([^:]+):'))
      redis.call('PUBLISH', ns .. ':rel:' .. ingress, m)
      released[#released + 1] = m
    end
  end
  return released
end
"""

# ARGV: ns, ingress, tenant, weight, priority, cost, count, cap, max waiting (-1: none).
# Returns {state, tag, member}: state 1 admitted now, 0 waiting as member, -1 the queue full.
ENTER = (
    _COMMON
    + """
local ns, ingress, tenant = ARGV[1], ARGV[2], ARGV[3]
local weight, priority, cost = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local count, cap, max_waiting = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local v = tonumber(redis.call('HGET', ns .. ':st', 'V')) or 0
local f = tonumber(redis.call('HGET', ns .. ':st', 'F:' .. tenant)) or 0
local tag = math.max(v, f)
local waiting = redis.call('ZCARD', ns .. ':wait')
local total = live_in_flight(ns)
if waiting == 0 and (total == 0 or total + count <= cap) then
  redis.call('HINCRBY', ns .. ':inf', ingress, count)
  redis.call('HSET', ns .. ':st', 'V', tostring(tag), 'F:' .. tenant, tostring(tag + cost / weight))
  return {1, tostring(tag), ''}
end
if max_waiting >= 0 and waiting >= max_waiting then return {-1, tostring(tag), ''} end
redis.call('HSET', ns .. ':st', 'F:' .. tenant, tostring(tag + cost / weight))
local arrival = redis.call('INCR', ns .. ':arrivals')
local member = string.format('%d:%024.6f:%015d', 9 - priority, tag, arrival)
redis.call('ZADD', ns .. ':wait', 0, member)
redis.call('HSET', ns .. ':wm', member, ingress .. ' ' .. count)
release(ns, cap)
return {0, tostring(tag), member}
"""
)

# ARGV: ns, ingress, tenant, count, finish-tag correction ((actual - estimated) / weight), cap
LEAVE = (
    _COMMON
    + """
local ns, ingress, tenant = ARGV[1], ARGV[2], ARGV[3]
local left = redis.call('HINCRBY', ns .. ':inf', ingress, -tonumber(ARGV[4]))
if left <= 0 then redis.call('HDEL', ns .. ':inf', ingress) end
redis.call('HINCRBYFLOAT', ns .. ':st', 'F:' .. tenant, ARGV[5])
return release(ns, tonumber(ARGV[6]))
"""
)

# ARGV: ns, member, tenant, cost / weight, cap. Returns 1 if the waiter was still waiting
# (now gone, its tenant not charged), 0 if it was released already (it holds its slots).
WITHDRAW = (
    _COMMON
    + """
local ns, member = ARGV[1], ARGV[2]
if redis.call('ZREM', ns .. ':wait', member) == 0 then return 0 end
redis.call('HDEL', ns .. ':wm', member)
redis.call('HINCRBYFLOAT', ns .. ':st', 'F:' .. ARGV[3], -tonumber(ARGV[4]))
release(ns, tonumber(ARGV[5]))
return 1
"""
)

# ARGV: ns, ingress, alive ms, cap. Renews the ingress, drops dead ones, releases what fits.
BEAT = (
    _COMMON
    + """
redis.call('SET', ARGV[1] .. ':alive:' .. ARGV[2], '1', 'PX', tonumber(ARGV[3]))
return release(ARGV[1], tonumber(ARGV[4]))
"""
)
