-- KEYS: lock, the scope's counter. ARGV: owner, ttl (ms), counter start. Returns {token, 0}
-- when taken
-- (or already held by the owner: its token), {0, pttl} when another owner holds it.
--- @include "draw"
local r = redis.call('HMGET', KEYS[1], 'ow', 'tk')
if r[1] and r[1] ~= ARGV[1] then
  return {0, redis.call('PTTL', KEYS[1])}
end
local token = r[2]
if not r[1] then
  token = draw()
  redis.call('HSET', KEYS[1], 'ow', ARGV[1], 'tk', token)
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {tonumber(token), 0}
