-- KEYS: record, scope index. ARGV: owner, state, payload, result_ms, fingerprint, member,
-- replace_outcome (0/1), the owner from now on.
--- @include "now"
local r = redis.call('HMGET', KEYS[1], 'ow', 'ct', 'st')
if r[1] and r[1] ~= ARGV[1] then return 0 end
if ARGV[7] == '0' and r[3] and r[3] ~= 'in_progress' and
  (r[3] ~= 'failed' or redis.call('HSTRLEN', KEYS[1], 'pl') > 0) then return 0 end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'pl', ARGV[3], 'fp', ARGV[5], 'ow', ARGV[8],
  'ct', r[2] or now, 'ut', now)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], now + ARGV[4], ARGV[6])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
return 1
