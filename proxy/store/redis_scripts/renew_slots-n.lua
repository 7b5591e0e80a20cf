-- KEYS: slot sets. ARGV: owner, ttl (ms). 1 if every slot was still held.
--- @include "now_ms"
local kept = 1
for _, key in ipairs(KEYS) do
  local lease = tonumber(redis.call('ZSCORE', key, ARGV[1]) or 0)
  if lease > now then
    redis.call('ZADD', key, 'XX', now + ARGV[2], ARGV[1])
    local ttl = math.ceil(tonumber(ARGV[2]))
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  else
    kept = 0
  end
end
return kept
