"""The index's Lua scripts: every index operation is one of these, one round trip.

Longer than 300 lines because every operation's script is here, each beside the others it
must agree with (a booking, its prefill-done mark and its release; a query and the shares
it sums); the functions they share are in ``kvindex.lua``.

Key layout and semantics are documented in ``kvindex.keys``. Every script that writes a
replica's blocks first checks the caller's epoch, so a replaced replica cannot write.

Longer than 300 lines because it holds all thirteen scripts, each a short one: every
write to the index is read here against the same keys and the same log, in one place.
"""

from kvindex.lua import EMIT, LIVE, NOW, PURGE, UNBOOK

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
emit(ns, 'reg', rid, epoch)
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
emit(ns, 'dereg', rid)
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
# replace = 1 makes the stored hashes the replica's whole set (a resync). A removed block's
# prediction there goes with it.
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
-- a removed block is no longer predicted there either: a prediction stands in for blocks
-- a booked prefill will publish, and an eviction says they are gone (a mirror applying the
-- 'rem' event drops the same predictions)
local pr = ns .. ':pr:' .. rid
for i = 6 + n_stored, #ARGV do
  redis.call('SREM', ns .. ':b:' .. ARGV[i], rid)
  redis.call('SREM', rkey, ARGV[i])
  redis.call('ZREM', ns .. ':pb:' .. ARGV[i], rid)
  redis.call('ZREM', pr, ARGV[i])
end
if n_stored > 0 then emit(ns, 'add', rid, table.concat(ARGV, '', 6, 5 + n_stored)) end
if #ARGV > 5 + n_stored then emit(ns, 'rem', rid, table.concat(ARGV, '', 6 + n_stored)) end
local footprint = redis.call('SCARD', rkey)
redis.call('HSET', ns .. ':fp', rid, footprint)
return footprint
"""
)

# ARGV: ns, hashes... For every live replica: rid, leading hashes it holds (published,
# stopping at its first miss), leading hashes predicted there (booked by a router, not
# expired), its footprint (blocks held), and its booked prefill tokens, active requests and
# decode blocks. Block-major: the chain is walked once, each block's holders read from its
# own set, and the walk stops where no live replica continues, so a query costs the holders
# of the prompt's matched blocks plus a few whole-hash reads, not a few calls per replica.

# What QUERY answers for each live replica, after its id, in this order (the names of
# ``kvindex.records.ReplicaState``'s fields; a test holds the two together).
QUERY_FIELDS = (
    "cached_blocks",
    "predicted_blocks",
    "footprint_blocks",
    "prefill_tokens",
    "in_flight",
    "decode_blocks",
)

QUERY = (
    NOW
    + LIVE
    + """
local ns = ARGV[1]
local now = now_ms()
local live, order = live_replicas(ns)
-- published runs: the replicas holding every block so far are intersected with the next
-- block's holders in Redis (in C: SINTERCARD counts without copying, the common case when
-- every holder continues; SINTERSTORE and SDIFF only where some drop out), and Lua names
-- each replica once, at the block where it drops out
local held, cur, nxt = {}, ns .. ':q:a', ns .. ':q:b'
local size = #ARGV >= 2 and redis.call('SUNIONSTORE', cur, ns .. ':b:' .. ARGV[2]) or 0
local i = 1
while size > 0 do
  local block = ARGV[i + 2] and ns .. ':b:' .. ARGV[i + 2]
  local stay = block and redis.call('SINTERCARD', 2, cur, block) or 0
  if stay < size then  -- some hold exactly blocks 1..i
    if stay > 0 then redis.call('SINTERSTORE', nxt, cur, block) end
    local gone = stay == 0 and redis.call('SMEMBERS', cur) or redis.call('SDIFF', cur, nxt)
    for _, rid in ipairs(gone) do held[rid] = i end
    cur, nxt = nxt, cur
  end
  size, i = stay, i + 1
end
redis.call('DEL', ns .. ':q:a', ns .. ':q:b')
-- predicted runs: few replicas per block (those routers just sent it to): walked in Lua
local predicted, alive = {}, nil
for i = 2, #ARGV do
  local next_alive, any = {}, false
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', ns .. ':pb:' .. ARGV[i], '(' .. now, '+inf')) do
    if alive == nil or alive[rid] then next_alive[rid], predicted[rid], any = true, i - 1, true end
  end
  if not any then break end
  alive = next_alive
end
local function as_map(flat)
  local m = {}
  for i = 1, #flat, 2 do m[flat[i]] = tonumber(flat[i + 1]) end
  return m
end
local fp = as_map(redis.call('HGETALL', ns .. ':fp'))
local loads = as_map(redis.call('HGETALL', ns .. ':loads'))
local flat = {}
for _, rid in ipairs(order) do
  flat[#flat + 1] = rid
  flat[#flat + 1] = held[rid] or 0
  flat[#flat + 1] = predicted[rid] or 0
  flat[#flat + 1] = fp[rid] or 0
  flat[#flat + 1] = loads[rid .. ':prefill_tokens'] or 0
  flat[#flat + 1] = loads[rid .. ':in_flight'] or 0
  flat[#flat + 1] = loads[rid .. ':decode_blocks'] or 0
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
    + EMIT
    + UNBOOK
    + """
local ns, rep, req = ARGV[1], ARGV[2], ARGV[3]
local now = now_ms()
local bk = ns .. ':bk:' .. rep
for _, old in ipairs(redis.call('ZRANGEBYSCORE', bk, '-inf', now)) do unbook(ns, rep, old) end
unbook(ns, rep, req)
redis.call('ZADD', bk, now + tonumber(ARGV[6]), req)
redis.call('HSET', ns .. ':bt:' .. rep, req, ARGV[4] .. ':' .. ARGV[5])
add(ns, rep, 'prefill_tokens', tonumber(ARGV[4]))
add(ns, rep, 'decode_blocks', tonumber(ARGV[5]))
add(ns, rep, 'in_flight', 1)
-- each block's predicted holders, by expiry; a block's key lives no longer than its newest
-- prediction, so expired members go with it unless a router keeps predicting the block.
-- The replica's own list of what was predicted there lets a purge find them.
local ttl, pr = tonumber(ARGV[7]), ns .. ':pr:' .. rep
redis.call('ZREMRANGEBYSCORE', pr, '-inf', now)
for i = 8, #ARGV do
  local pb = ns .. ':pb:' .. ARGV[i]
  redis.call('ZADD', pb, now + ttl, rep)
  redis.call('PEXPIRE', pb, ttl)
  redis.call('ZADD', pr, now + ttl, ARGV[i])
end
if #ARGV >= 8 then
  redis.call('PEXPIRE', pr, ttl)
  emit(ns, 'pred', rep, string.format('%d', now + ttl), table.concat(ARGV, '', 8))
end
return emit_load(ns, rep)
"""
)

# ARGV: ns, replica, request id. Its prompt is computed: it no longer counts as prefill.
PREFILL_DONE = (
    EMIT
    + UNBOOK
    + """
local ns, rep, req = ARGV[1], ARGV[2], ARGV[3]
local bt = ns .. ':bt:' .. rep
local fields = redis.call('HGET', bt, req)
if not fields then return 0 end
local sep = string.find(fields, ':')
add(ns, rep, 'prefill_tokens', -tonumber(string.sub(fields, 1, sep - 1)))
redis.call('HSET', bt, req, '0' .. string.sub(fields, sep))
return emit_load(ns, rep)
"""
)

# ARGV: ns, replica, request id. The request is over (finished, failed or aborted).
RELEASE = (
    EMIT
    + UNBOOK
    + """
if unbook(ARGV[1], ARGV[2], ARGV[3]) == 0 then return 0 end
return emit_load(ARGV[1], ARGV[2])
"""
)


# ARGV: ns, min interval ms (0: always). Purges and forgets every registered replica whose
# heartbeat has expired. Every replica calls this now and then; with an interval, at most
# one call per interval does the work for the whole cluster (the others return -1), so
# reaping costs O(replicas) per interval, not per replica.
REAP = (
    PURGE
    + LIVE
    + """
local ns, interval = ARGV[1], tonumber(ARGV[2])
if interval > 0 and not redis.call('SET', ns .. ':reaping', '1', 'PX', interval, 'NX') then
  return -1
end
local live = live_replicas(ns)
local reaped = 0
for rid, alive in pairs(live) do
  if not alive then
    purge(ns, rid)
    redis.call('HDEL', ns .. ':replicas', rid)
    emit(ns, 'dereg', rid)
    reaped = reaped + 1
  end
end
return reaped
"""
)


# ARGV: ns, router, ttl ms, totals ("replica:prefill_tokens:in_flight:decode_blocks,..."),
# predict ttl ms, then pairs: replica, hashes (concatenated). A router that routes from a
# mirror shares its bookings this way, a few times a second, instead of one booking script
# per request:
# its whole totals (they replace its last ones; they lapse after the ttl unless renewed)
# and the prompts it sent where since (predicted held there until the predict ttl).
SHARE = (
    NOW
    + EMIT
    + """
local ns, router, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local payload = string.format('%d', now + ttl) .. '|' .. ARGV[4]
redis.call('SET', ns .. ':rl:' .. router, payload, 'PX', ttl)
local routers = redis.call('HGETALL', ns .. ':routers')
for i = 1, #routers, 2 do
  if tonumber(routers[i + 1]) < now then redis.call('HDEL', ns .. ':routers', routers[i]) end
end
redis.call('HSET', ns .. ':routers', router, now + ttl)
redis.call('PEXPIRE', ns .. ':routers', ttl)  -- gone a ttl after the last router's share
local seq = emit(ns, 'share', router, payload)
local expiry = string.format('%d', now + tonumber(ARGV[5]))
for i = 6, #ARGV - 1, 2 do seq = emit(ns, 'pred', ARGV[i], expiry, ARGV[i + 1]) end
return seq
"""
)

# ARGV: ns, router. A router stopping cleanly withdraws its shared bookings at once (its
# requests ended with it), rather than leaving them counted until they lapse; the mirrors
# see an empty share that has already expired.
UNSHARE = (
    EMIT
    + """
local ns, router = ARGV[1], ARGV[2]
redis.call('DEL', ns .. ':rl:' .. router)
redis.call('HDEL', ns .. ':routers', router)
return emit(ns, 'share', router, '0|')
"""
)

# ARGV: ns. What a mirror starts from (``kvindex.mirror``), read at one instant: the log's
# name and last sequence number, the registry (id, epoch, ...), the loads hash and the
# routers' shared bookings (router, payload, ...). The blocks are read after, replica by
# replica (set operations: replaying the log from this sequence number on makes them exact
# whatever the interleaving).
SNAPSHOT = """
local ns = ARGV[1]
local shares = {}
for _, router in ipairs(redis.call('HKEYS', ns .. ':routers')) do
  local payload = redis.call('GET', ns .. ':rl:' .. router)
  if payload then shares[#shares + 1] = router; shares[#shares + 1] = payload end
end
return {
  redis.call('GET', ns .. ':evid') or '',
  redis.call('GET', ns .. ':evseq') or '0',
  redis.call('HGETALL', ns .. ':replicas'),
  redis.call('HGETALL', ns .. ':loads'),
  shares,
}
"""

# ARGV: ns. The registered replicas whose heartbeat is current, and the log's name and last
# sequence number (a mirror's poll: liveness is not logged, it expires).
LIVE_NOW = (
    LIVE
    + """
local ns = ARGV[1]
local _, order = live_replicas(ns)
return {redis.call('GET', ns .. ':evid') or '', redis.call('GET', ns .. ':evseq') or '0', order,
  redis.call('TIME')}
"""
)
