-- KEYS: record, scope index. ARGV: new state ('' to delete), payload, result_ms, owner
-- ('' for any), index member.
--- @include "now"
local r = redis.call('HMGET', KEYS[1], 'st', 'ow')
if r[1] ~= 'failed' or (ARGV[4] ~= '' and r[2] ~= ARGV[4]) then return 0 end
if ARGV[1] == '' then
  redis.call('ZREM', KEYS[2], ARGV[5])
  return redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'st', ARGV[1], 'pl', ARGV[2], 'ut', now, 'ix', now + ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], now + ARGV[3], ARGV[5])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return 1
