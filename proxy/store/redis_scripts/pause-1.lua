-- KEYS: pause. ARGV: seconds (ms).
--- @include "now_ms"
local stop = now + tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[1]) or 0) < stop then
  redis.call('SET', KEYS[1], string.format('%.3f', stop), 'PX', math.ceil(tonumber(ARGV[1])) + 1)
end
return 1
