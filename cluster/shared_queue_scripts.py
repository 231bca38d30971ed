"""The shared fair queue's Lua scripts (``cluster.shared_queue``): each runs atomically in
Redis, so two ingresses never both take the last slot or release out of order.

Keys, under the namespace ``ns`` (ARGV[1] of every script): ``ns:st`` (hash: ``V``, the
start tag of the request released last; ``F:<tenant>``, each tenant's last finish tag),
``ns:wait`` (sorted set, all scores 0, ordered by member: ``<9 - priority>:<start tag,
zero-padded>:<arrival, zero-padded>``, so the first member is the next to go), ``ns:wm``
(hash: member -> ``<ingress> <count> <priority> <tenant>``), ``ns:inf`` (hash: ingress ->
its requests in the engines), ``ns:run:<ingress>`` (hash: ``t:<tenant>`` and
``p:<priority>`` -> that ingress's requests in the engines of each), ``ns:w`` (hash: tenant
-> its weight), ``ns:wt`` (hash: tenant -> its waiters), ``ns:alive:<ingress>`` (expires
unless the ingress renews it) and ``ns:rel:<ingress>`` (the channel where an ingress hears
which of its waiters were released: the member, then `` x`` if on an express slot). An
ingress whose ``alive`` key expired is dropped: its requests stop counting and its waiters
are removed.

Express slots (``extra`` beyond ``cap``) follow ``cluster.fair_queue``'s rule over the whole
cluster: the next request in the order (or one arriving ahead of every waiter) starts on
one if its priority is above the lowest running anywhere, or its tenant runs fewer than
its weighted share of ``cap`` among the tenants running or waiting anywhere.
"""

from __future__ import annotations

_COMMON = """
local function live_in_flight(ns)
  local t = redis.call('HGETALL', ns .. ':inf')
  local total = 0
  for i = 1, #t, 2 do
    if redis.call('EXISTS', ns .. ':alive:' .. t[i]) == 1 then
      total = total + tonumber(t[i + 1])
    else
      redis.call('HDEL', ns .. ':inf', t[i])
      redis.call('DEL', ns .. ':run:' .. t[i])
    end
  end
  return total
end
local function count_run(ns, ingress, tenant, priority, count)
  local key = ns .. ':run:' .. ingress
  for _, field in ipairs({'t:' .. tenant, 'p:' .. priority}) do
    if redis.call('HINCRBY', key, field, count) <= 0 then redis.call('HDEL', key, field) end
  end
end
local function count_wait(ns, tenant, count)
  if redis.call('HINCRBY', ns .. ':wt', tenant, count) <= 0 then
    redis.call('HDEL', ns .. ':wt', tenant)
  end
end
local function running(ns)
  local tenants, lowest = {}, nil
  for _, ingress in ipairs(redis.call('HKEYS', ns .. ':inf')) do
    local r = redis.call('HGETALL', ns .. ':run:' .. ingress)
    for i = 1, #r, 2 do
      local kind, name, n = string.sub(r[i], 1, 1), string.sub(r[i], 3), tonumber(r[i + 1])
      if kind == 't' then
        tenants[name] = (tenants[name] or 0) + n
      elseif n > 0 and (lowest == nil or tonumber(name) < lowest) then
        lowest = tonumber(name)
      end
    end
  end
  return tenants, lowest
end
local function may_express(ns, tenant, priority, count, cap, extra, total)
  if extra <= 0 or total + count > cap + extra then return false end
  local tenants, lowest = running(ns)
  if lowest ~= nil and priority > lowest then return true end
  local active = {[tenant] = true}
  for name, n in pairs(tenants) do if n > 0 then active[name] = true end end
  local waiting = redis.call('HGETALL', ns .. ':wt')
  for i = 1, #waiting, 2 do active[waiting[i]] = true end
  local weights = 0
  for name, _ in pairs(active) do
    weights = weights + (tonumber(redis.call('HGET', ns .. ':w', name)) or 1)
  end
  local weight = tonumber(redis.call('HGET', ns .. ':w', tenant)) or 1
  return (tenants[tenant] or 0) + count <= cap * weight / weights
end
-- release(ns, cap, extra): every head that fits goes, in order (the first that does not
-- fit may take an express slot, never one behind it); returns the members released
local function release(ns, cap, extra)
  local total = live_in_flight(ns)
  local released = {}
  while true do
    local head = redis.call('ZRANGE', ns .. ':wait', 0, 0)
    if #head == 0 then break end
    local m = head[1]
    local owner = redis.call('HGET', ns .. ':wm', m) or ''
    local ingress, count, priority, tenant = string.match(owner, '^(%S+) (%d+) (%-?%d+) (.*)$')
    count = tonumber(count) or 1
    if ingress ~= nil and redis.call('EXISTS', ns .. ':alive:' .. ingress) == 0 then
      ingress = nil
    end
    local express = ''
    if ingress ~= nil and total > 0 and total + count > cap then
      if not may_express(ns, tenant, tonumber(priority), count, cap, extra, total) then break end
      express = ' x'
    end
    redis.call('ZREM', ns .. ':wait', m)
    redis.call('HDEL', ns .. ':wm', m)
    if tenant ~= nil then count_wait(ns, tenant, -1) end
    if ingress ~= nil then
      redis.call('HINCRBY', ns .. ':inf', ingress, count)
      count_run(ns, ingress, tenant, priority, count)
      total = total + count
      redis.call('HSET', ns .. ':st', 'V', string.match(m, '^%d:([^:]+):'))
      redis.call('PUBLISH', ns .. ':rel:' .. ingress, m .. express)
      released[#released + 1] = m
    end
  end
  return released
end
"""

# ARGV: ns, ingress, tenant, weight, priority, cost, count, cap, max waiting (-1: none),
# extra (express slots). Returns {state, tag, member}: state 1 admitted now, 2 admitted on
# an express slot, 0 waiting as member, -1 the queue full.
ENTER = (
    _COMMON
    + """
local ns, ingress, tenant = ARGV[1], ARGV[2], ARGV[3]
local weight, priority, cost = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local count, cap, max_waiting = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local extra = tonumber(ARGV[10])
redis.call('HSET', ns .. ':w', tenant, tostring(weight))
local v = tonumber(redis.call('HGET', ns .. ':st', 'V')) or 0
local f = tonumber(redis.call('HGET', ns .. ':st', 'F:' .. tenant)) or 0
local tag = math.max(v, f)
local waiting = redis.call('ZCARD', ns .. ':wait')
local total = live_in_flight(ns)
local arrival = redis.call('INCR', ns .. ':arrivals')
local member = string.format('%d:%024.6f:%015d', 9 - priority, tag, arrival)
local state = 0
if waiting == 0 and (total == 0 or total + count <= cap) then
  state = 1
else
  local head = redis.call('ZRANGE', ns .. ':wait', 0, 0)
  local first = #head == 0 or member < head[1]
  if first and may_express(ns, tenant, priority, count, cap, extra, total) then state = 2 end
end
if state > 0 then
  redis.call('HINCRBY', ns .. ':inf', ingress, count)
  count_run(ns, ingress, tenant, priority, count)
  redis.call('HSET', ns .. ':st', 'V', tostring(tag), 'F:' .. tenant, tostring(tag + cost / weight))
  return {state, tostring(tag), ''}
end
if max_waiting >= 0 and waiting >= max_waiting then return {-1, tostring(tag), ''} end
redis.call('HSET', ns .. ':st', 'F:' .. tenant, tostring(tag + cost / weight))
redis.call('ZADD', ns .. ':wait', 0, member)
redis.call('HSET', ns .. ':wm', member, ingress .. ' ' .. count .. ' ' .. priority .. ' ' .. tenant)
count_wait(ns, tenant, 1)
release(ns, cap, extra)
return {0, tostring(tag), member}
"""
)

# ARGV: ns, ingress, tenant, count, finish-tag correction ((actual - estimated) / weight),
# cap, priority, extra
LEAVE = (
    _COMMON
    + """
local ns, ingress, tenant = ARGV[1], ARGV[2], ARGV[3]
local left = redis.call('HINCRBY', ns .. ':inf', ingress, -tonumber(ARGV[4]))
if left <= 0 then redis.call('HDEL', ns .. ':inf', ingress) end
count_run(ns, ingress, tenant, ARGV[7], -tonumber(ARGV[4]))
redis.call('HINCRBYFLOAT', ns .. ':st', 'F:' .. tenant, ARGV[5])
return release(ns, tonumber(ARGV[6]), tonumber(ARGV[8]))
"""
)

# ARGV: ns, member, tenant, cost / weight, cap, extra. Returns 1 if the waiter was still
# waiting (now gone, its tenant not charged), 0 if it was released already (it holds its
# slots).
WITHDRAW = (
    _COMMON
    + """
local ns, member = ARGV[1], ARGV[2]
if redis.call('ZREM', ns .. ':wait', member) == 0 then return 0 end
redis.call('HDEL', ns .. ':wm', member)
count_wait(ns, ARGV[3], -1)
redis.call('HINCRBYFLOAT', ns .. ':st', 'F:' .. ARGV[3], -tonumber(ARGV[4]))
release(ns, tonumber(ARGV[5]), tonumber(ARGV[6]))
return 1
"""
)

# ARGV: ns, ingress, alive ms, cap, extra. Renews the ingress, drops dead ones, releases
# what fits.
BEAT = (
    _COMMON
    + """
redis.call('SET', ARGV[1] .. ':alive:' .. ARGV[2], '1', 'PX', tonumber(ARGV[3]))
return release(ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5]))
"""
)
