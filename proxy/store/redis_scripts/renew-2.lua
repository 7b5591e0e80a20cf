-- KEYS: record, scope index. ARGV: owner, lock_ms, result_ms, index member.
--- @include "now"
local r = redis.call('HMGET', KEYS[1], 'st', 'ow')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
if redis.call('PTTL', KEYS[1]) >= tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], 'lu', now + ARGV[2], 'ut', now)
  return 1
end
-- extended: its score in the index (ix) moves with it
redis.call('HSET', KEYS[1], 'lu', now + ARGV[2], 'ut', now, 'ix', now + ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], 'GT', now + ARGV[3], ARGV[4])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
