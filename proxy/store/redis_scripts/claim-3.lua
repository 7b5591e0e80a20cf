-- KEYS: record, slot pointer, scope index. ARGV: name, fingerprint, owner, lock_ms,
-- result_ms, reexecute_lapsed (0/1), index member, replay (0/1). The index drops the
-- members whose record expired (their score passed) as a new one comes in; its own life
-- is extended twice as far as needed, so most claims skip that write. A finished record
-- handed back with the same fingerprint is a replay served: its rp goes up by one here.
--- @include "now"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'ow', 'pl', 'lu', 'ct', 'ut', 'rp')
if r[1] and (r[3] ~= ARGV[3] or r[1] ~= 'in_progress') then
  local served = ARGV[8] == '1' and r[2] == ARGV[2]
  if r[1] ~= 'in_progress' then
    local rp = r[8] or 0
    if served then -- counted if the store takes writes: a full or fenced one still replays
      local counted = redis.pcall('HINCRBY', KEYS[1], 'rp', 1)
      if type(counted) == 'number' then rp = counted end
    end
    return {0, r[1], r[2], r[3], r[4] or '', redis.call('PTTL', KEYS[1]), r[6], r[7], rp}
  end
  local left = tonumber(r[5] or 0) - now
  if left > 0 then return {0, r[1], r[2], r[3], '', left, r[6], r[7], r[8] or 0} end
  if ARGV[6] == '0' then
    local rp = tonumber(r[8] or 0) + (served and 1 or 0)
    redis.call('HSET', KEYS[1], 'st', 'failed', 'pl', '', 'ut', now, 'rp', rp)
    return {0, 'failed', r[2], r[3], '', redis.call('PTTL', KEYS[1]), r[6], now, rp}
  end
end
if r[1] then redis.call('HDEL', KEYS[1], 'pl', 'rp') end -- a fresh record has none
redis.call('HSET', KEYS[1], 'st', 'in_progress', 'fp', ARGV[2], 'ow', ARGV[3],
  'lu', now + ARGV[4], 'ct', now, 'ut', now)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZADD', KEYS[3], now + ARGV[5], ARGV[7])
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[5]) then
  redis.call('PEXPIRE', KEYS[3], ARGV[5] * 2)
end
local prev = redis.call('SET', KEYS[2], ARGV[1], 'GET', 'PX', ARGV[5])
return {1, prev or ''}
