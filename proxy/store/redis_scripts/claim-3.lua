-- KEYS: record, slot pointer, scope index. ARGV: name, fingerprint, owner, lock_ms,
-- result_ms, reexecute_lapsed (0/1), index member, replay (0/1). The record's score in
-- the index, also kept in the record as ix, is when the record expires unless a later
-- script moves it (result_ms covers the lease: a complete within the lease leaves the
-- index alone). The index drops the members whose score passed as a new one comes in
-- (a new index has none); its own life is extended twice as far as needed, so most
-- claims skip that write. A finished record handed back with the same fingerprint is a
-- replay served: its rp goes up by one here (the server's clock is not read for it).
--- @include "ms"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'ow', 'pl', 'lu', 'ct', 'ut', 'rp')
local served = ARGV[8] == '1' and r[2] == ARGV[2]
if r[1] and r[1] ~= 'in_progress' then -- a finished record: no clock needed
  local rp = r[8] or 0
  if served then -- counted if the store takes writes: a full or fenced one still replays
    local counted = redis.pcall('HINCRBY', KEYS[1], 'rp', 1)
    if type(counted) == 'number' then rp = counted end
  end
  return {0, r[1], r[2], r[3], r[4] or '', redis.call('PTTL', KEYS[1]), r[6], r[7], rp}
end
--- @include "now"
if r[1] and r[3] ~= ARGV[3] then -- in progress, another owner's
  local left = tonumber(r[5] or 0) - now
  if left > 0 then return {0, r[1], r[2], r[3], '', left, r[6], r[7], r[8] or 0} end
  if ARGV[6] == '0' then
    local rp = tonumber(r[8] or 0) + (served and 1 or 0)
    redis.call('HSET', KEYS[1], 'st', 'failed', 'pl', '', 'ut', now, 'rp', rp)
    return {0, 'failed', r[2], r[3], '', redis.call('PTTL', KEYS[1]), r[6], now, rp}
  end
end
if r[1] then redis.call('HDEL', KEYS[1], 'pl', 'rp') end -- a fresh record has none
local at, ix = ms(now), ms(now + ARGV[5])
redis.call('HSET', KEYS[1], 'st', 'in_progress', 'fp', ARGV[2], 'ow', ARGV[3],
  'lu', ms(now + ARGV[4]), 'ct', at, 'ut', at, 'ix', ix)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
local ttl = redis.call('PTTL', KEYS[3])
redis.call('ZADD', KEYS[3], ix, ARGV[7]) -- before the prune, which so never empties it
if ttl ~= -2 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', at) end
if ttl < tonumber(ARGV[5]) then redis.call('PEXPIRE', KEYS[3], ms(ARGV[5] * 2)) end
local prev = redis.call('SET', KEYS[2], ARGV[1], 'GET', 'PX', ARGV[5])
return {1, prev or ''}
