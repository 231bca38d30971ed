"""The index's Lua scripts: every index operation is one of these, one round trip.

Key layout and semantics are documented in ``replica.index``. Every script that writes a
replica's blocks first checks the caller's epoch, so a replaced replica cannot write.
"""

# Shared by the scripts: drop everything of replica ``rid``: its blocks, stats, bookings
# and predicted blocks.
PURGE = """
local function purge(ns, rid)
  local rkey = ns .. ':r:' .. rid
  local blocks = redis.call('SMEMBERS', rkey)
  for _, h in ipairs(blocks) do redis.call('SREM', ns .. ':b:' .. h, rid) end
  redis.call('DEL', rkey, ns .. ':stats:' .. rid, ns .. ':pr:' .. rid, ns .. ':bk:' .. rid,
             ns .. ':bt:' .. rid, ns .. ':load:' .. rid)
  return #blocks
end
"""

# Shared: the server's clock in ms (bookings and predictions expire by it, whoever writes).
NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Shared: add to a replica's totals (Redis refuses "-0" as an integer: zero is skipped), and
# take a booking off them (``fields`` = "prefill:decode").
UNBOOK = """
local function add(load, field, n)
  if n ~= 0 then redis.call('HINCRBY', load, field, string.format('%d', n)) end
end
local function unbook(ns, rep, req)
  local bt, load = ns .. ':bt:' .. rep, ns .. ':load:' .. rep
  local fields = redis.call('HGET', bt, req)
  if not fields then return 0 end
  local sep = string.find(fields, ':')
  add(load, 'prefill', -tonumber(string.sub(fields, 1, sep - 1)))
  add(load, 'decode', -tonumber(string.sub(fields, sep + 1)))
  add(load, 'active', -1)
  redis.call('HDEL', bt, req)
  redis.call('ZREM', ns .. ':bk:' .. rep, req)
  return 1
end
"""

# KEYS: none (all keys derive from ARGV[1] = ns). ARGV: ns, rid, epoch, ttl_ms.
REGISTER = (
    PURGE
    + """
local ns, rid, epoch = ARGV[1], ARGV[2], ARGV[3]
local old = redis.call('HGET', ns .. ':replicas', rid)
local purged = 0
if old ~= epoch then purged = purge(ns, rid) end
redis.call('HSET', ns .. ':replicas', rid, epoch)
redis.call('SET', ns .. ':hb:' .. rid, epoch, 'PX', ARGV[4])
return purged
"""
)

# ARGV: ns, rid, epoch. Purges and forgets the replica if the epoch is still its own.
DEREGISTER = (
    PURGE
    + """
local ns, rid = ARGV[1], ARGV[2]
if redis.call('HGET', ns .. ':replicas', rid) ~= ARGV[3] then return -1 end
local n = purge(ns, rid)
redis.call('HDEL', ns .. ':replicas', rid)
redis.call('DEL', ns .. ':hb:' .. rid)
return n
"""
)

# ARGV: ns, rid, epoch, ttl_ms, stats json ('' for none). 1 = refreshed, 0 = not
# registered with this epoch.
HEARTBEAT = """
local ns, rid, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', ns .. ':replicas', rid) ~= epoch then return 0 end
redis.call('SET', ns .. ':hb:' .. rid, epoch, 'PX', ARGV[4])
if ARGV[5] ~= '' then redis.call('SET', ns .. ':stats:' .. rid, ARGV[5], 'PX', ARGV[4]) end
return 1
"""

# ARGV: ns, rid, epoch, replace (0/1), n_stored, stored..., removed...
# replace = 1 makes the stored hashes the replica's whole set (a resync).
PUBLISH = (
    PURGE
    + """
local ns, rid, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', ns .. ':replicas', rid) ~= epoch then return -1 end
if ARGV[4] == '1' then purge(ns, rid) end
local n_stored = tonumber(ARGV[5])
local rkey = ns .. ':r:' .. rid
for i = 6, 5 + n_stored do
  redis.call('SADD', ns .. ':b:' .. ARGV[i], rid)
  redis.call('SADD', rkey, ARGV[i])
end
for i = 6 + n_stored, #ARGV do
  redis.call('SREM', ns .. ':b:' .. ARGV[i], rid)
  redis.call('SREM', rkey, ARGV[i])
end
return redis.call('SCARD', rkey)
"""
)

# ARGV: ns, hashes... Returns {rid, length, ...} for every live replica, where length is the
# number of leading hashes it holds (stopping at its first miss). Each replica's own block set
# is probed with SMISMEMBER in chunks that grow, so a short match costs one small call.
QUERY = (
    NOW
    + """
local ns = ARGV[1]
local n = #ARGV - 1
local now = now_ms()
local reg = redis.call('HGETALL', ns .. ':replicas')
local flat = {}
local function run_of(key, is_set)
  local held, first, size = 0, 1, 8
  while first <= n do
    local last = math.min(first + size - 1, n)
    local found
    if is_set then
      found = redis.call('SMISMEMBER', key, unpack(ARGV, first + 1, last + 1))
    else
      found = redis.call('ZMSCORE', key, unpack(ARGV, first + 1, last + 1))
    end
    local run = 0
    while run < #found do
      local f = found[run + 1]
      if is_set then
        if f ~= 1 then break end
      elseif not f or tonumber(f) <= now then break end
      run = run + 1
    end
    held = held + run
    if run < #found then break end
    first, size = last + 1, math.min(size * 4, 1024)
  end
  return held
end
for i = 1, #reg, 2 do
  local rid = reg[i]
  if redis.call('GET', ns .. ':hb:' .. rid) == reg[i + 1] then
    local load = redis.call('HMGET', ns .. ':load:' .. rid, 'prefill', 'active', 'decode')
    flat[#flat + 1] = rid
    flat[#flat + 1] = run_of(ns .. ':r:' .. rid, true)
    flat[#flat + 1] = run_of(ns .. ':pr:' .. rid, false)
    flat[#flat + 1] = redis.call('SCARD', ns .. ':r:' .. rid)
    flat[#flat + 1] = tonumber(load[1] or 0)
    flat[#flat + 1] = tonumber(load[2] or 0)
    flat[#flat + 1] = tonumber(load[3] or 0)
  end
end
return flat
"""
)

# ARGV: ns, replica, request id, prefill tokens, decode blocks, booking ttl ms,
# predict ttl ms, hashes... Books a routed request on its replica (first dropping that
# replica's expired bookings: those whose release was lost) and records its prompt's
# blocks as predicted-held there until the replica publishes them.
BOOK = (
    NOW
    + UNBOOK
    + """
local ns, rep, req = ARGV[1], ARGV[2], ARGV[3]
local now = now_ms()
local bk, pr = ns .. ':bk:' .. rep, ns .. ':pr:' .. rep
for _, old in ipairs(redis.call('ZRANGEBYSCORE', bk, '-inf', now)) do unbook(ns, rep, old) end
unbook(ns, rep, req)
redis.call('ZADD', bk, now + tonumber(ARGV[6]), req)
redis.call('HSET', ns .. ':bt:' .. rep, req, ARGV[4] .. ':' .. ARGV[5])
local load = ns .. ':load:' .. rep
add(load, 'prefill', tonumber(ARGV[4]))
add(load, 'decode', tonumber(ARGV[5]))
add(load, 'active', 1)
redis.call('ZREMRANGEBYSCORE', pr, '-inf', now)
local expiry = now + tonumber(ARGV[7])
for i = 8, #ARGV do redis.call('ZADD', pr, expiry, ARGV[i]) end
return 1
"""
)

# ARGV: ns, replica, request id. Its prompt is computed: it no longer counts as prefill.
PREFILL_DONE = (
    UNBOOK
    + """
local ns, rep, req = ARGV[1], ARGV[2], ARGV[3]
local bt = ns .. ':bt:' .. rep
local fields = redis.call('HGET', bt, req)
if not fields then return 0 end
local sep = string.find(fields, ':')
add(ns .. ':load:' .. rep, 'prefill', -tonumber(string.sub(fields, 1, sep - 1)))
redis.call('HSET', bt, req, '0' .. string.sub(fields, sep))
return 1
"""
)

# ARGV: ns, replica, request id. The request is over (finished, failed or aborted).
RELEASE = (
    UNBOOK
    + """
return unbook(ARGV[1], ARGV[2], ARGV[3])
"""
)


# ARGV: ns. Purges and forgets every registered replica whose heartbeat has expired.
REAP = (
    PURGE
    + """
local ns = ARGV[1]
local reg = redis.call('HGETALL', ns .. ':replicas')
local reaped = 0
for i = 1, #reg, 2 do
  if redis.call('GET', ns .. ':hb:' .. reg[i]) ~= reg[i + 1] then
    purge(ns, reg[i])
    redis.call('HDEL', ns .. ':replicas', reg[i])
    reaped = reaped + 1
  end
end
return reaped
"""
)
