"""The Lua functions the index's scripts share (``kvindex.scripts`` builds each script by
prefixing the ones it calls): the log's ``emit``, a replica's ``purge``, the server's clock,
the bookings' arithmetic and the live set. Text only; Redis compiles each script once.
"""

# The most events the log keeps (trimmed approximately): a mirror that falls further
# behind than this resyncs (``kvindex.mirror``).
EVENTS_MAX_LEN = 100_000

# Shared: append one event to the namespace's log (a stream whose entry ids are sequence
# numbers, ``0-<seq>``, so a follower sees a gap as a jump). ``{ns}:evid`` names the log: a
# fresh Redis starts a new one (its first event stamps it with the server's time), so a
# follower notices a restart even before the sequence numbers say so. Events (``o``):
# ``reg`` (a = epoch), ``dereg``, ``purge`` (everything of the replica), ``add``/``rem``
# (a = hashes, 16 bytes each, concatenated), ``load`` (a = the replica's totals after the
# change, "prefill_tokens:in_flight:decode_blocks", ``kvindex.records.LOAD_FIELDS``'
# order: idempotent), ``pred`` (a = expiry ms, b = hashes).
EMIT = """
local function emit(ns, op, rid, a, b)
  local seq = redis.call('INCR', ns .. ':evseq')
  if seq == 1 or redis.call('EXISTS', ns .. ':evid') == 0 then
    local t = redis.call('TIME')
    redis.call('SET', ns .. ':evid', t[1] .. '.' .. t[2] .. '.' .. seq)
  end
  redis.call('XADD', ns .. ':ev', 'MAXLEN', '~', '{max_len}', '0-' .. seq,
    'o', op, 'r', rid, 'a', a or '', 'b', b or '')
  return seq
end
local function emit_load(ns, rid)
  local v = redis.call('HMGET', ns .. ':loads', rid .. ':prefill_tokens', rid .. ':in_flight',
    rid .. ':decode_blocks')
  return emit(ns, 'load', rid, (v[1] or 0) .. ':' .. (v[2] or 0) .. ':' .. (v[3] or 0))
end
""".replace("{max_len}", str(EVENTS_MAX_LEN))

# Shared by the scripts: drop everything of replica ``rid``: its blocks, predicted blocks,
# footprint, stats, bookings and load.
PURGE = (
    EMIT
    + """
local function purge(ns, rid)
  local rkey, pr = ns .. ':r:' .. rid, ns .. ':pr:' .. rid
  local blocks = redis.call('SMEMBERS', rkey)
  for _, h in ipairs(blocks) do redis.call('SREM', ns .. ':b:' .. h, rid) end
  for _, h in ipairs(redis.call('ZRANGE', pr, 0, -1)) do
    redis.call('ZREM', ns .. ':pb:' .. h, rid)
  end
  redis.call('DEL', rkey, pr, ns .. ':stats:' .. rid, ns .. ':bk:' .. rid, ns .. ':bt:' .. rid)
  redis.call('HDEL', ns .. ':fp', rid)
  redis.call('HDEL', ns .. ':loads', rid .. ':prefill_tokens', rid .. ':in_flight',
    rid .. ':decode_blocks')
  emit(ns, 'purge', rid)
  return #blocks
end
"""
)

# Shared: the server's clock in ms (bookings and predictions expire by it, whoever writes).
NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Shared: add to a replica's totals in the one loads hash (Redis refuses "-0" as an
# integer: zero is skipped), and take a booking off them (``fields`` = "prefill tokens:decode
# blocks").
UNBOOK = """
local function add(ns, rep, field, n)
  if n ~= 0 then
    redis.call('HINCRBY', ns .. ':loads', rep .. ':' .. field, string.format('%d', n))
  end
end
local function unbook(ns, rep, req)
  local bt = ns .. ':bt:' .. rep
  local fields = redis.call('HGET', bt, req)
  if not fields then return 0 end
  local sep = string.find(fields, ':')
  add(ns, rep, 'prefill_tokens', -tonumber(string.sub(fields, 1, sep - 1)))
  add(ns, rep, 'decode_blocks', -tonumber(string.sub(fields, sep + 1)))
  add(ns, rep, 'in_flight', -1)
  redis.call('HDEL', bt, req)
  redis.call('ZREM', ns .. ':bk:' .. rep, req)
  return 1
end
"""

# Shared: the registered replicas whose heartbeat is current, as a set (one MGET, in
# chunks that stay far below Lua's stack limit for unpack).
LIVE = """
local function live_replicas(ns)
  local reg = redis.call('HGETALL', ns .. ':replicas')
  local live, order = {}, {}
  for first = 1, #reg, 2000 do
    local last = math.min(first + 1999, #reg)
    local keys = {}
    for i = first, last, 2 do keys[#keys + 1] = ns .. ':hb:' .. reg[i] end
    local beats = redis.call('MGET', unpack(keys))
    for j, beat in ipairs(beats) do
      local i = first + 2 * (j - 1)
      if beat == reg[i + 1] then
        live[reg[i]] = true
        order[#order + 1] = reg[i]
      else
        live[reg[i]] = false
      end
    end
  end
  return live, order
end
"""
