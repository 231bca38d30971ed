"""The index's Lua scripts: every index operation is one of these, one round trip.

Key layout and semantics are documented in ``replica.index``. Every script that writes a
replica's blocks first checks the caller's epoch, so a replaced replica cannot write.
"""

# Shared by the scripts: drop every block of replica ARGV[1]; KEYS[1] = its block set.
PURGE = """
local function purge(ns, rid)
  local rkey = ns .. ':r:' .. rid
  local blocks = redis.call('SMEMBERS', rkey)
  for _, h in ipairs(blocks) do redis.call('SREM', ns .. ':b:' .. h, rid) end
  redis.call('DEL', rkey, ns .. ':stats:' .. rid)
  return #blocks
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
QUERY = """
local ns = ARGV[1]
local n = #ARGV - 1
local reg = redis.call('HGETALL', ns .. ':replicas')
local flat = {}
for i = 1, #reg, 2 do
  local rid = reg[i]
  if redis.call('GET', ns .. ':hb:' .. rid) == reg[i + 1] then
    local rkey, held, first, size = ns .. ':r:' .. rid, 0, 1, 8
    while first <= n do
      local last = math.min(first + size - 1, n)
      local found = redis.call('SMISMEMBER', rkey, unpack(ARGV, first + 1, last + 1))
      local run = 0
      while run < #found and found[run + 1] == 1 do run = run + 1 end
      held = held + run
      if run < #found then break end
      first, size = last + 1, math.min(size * 4, 1024)
    end
    flat[#flat + 1] = rid
    flat[#flat + 1] = held
  end
end
return flat
"""

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
