-- KEYS: a route's stream. ARGV: the idle time (ms) past which a consumer with no pending
-- entry is deleted (a worker that reads again is a consumer again). Returns how many.
--- @include "queue"
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local deleted = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], GROUP)) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if info['pending'] == 0 and info['idle'] > tonumber(ARGV[1]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], GROUP, info['name'])
    deleted = deleted + 1
  end
end
return deleted
