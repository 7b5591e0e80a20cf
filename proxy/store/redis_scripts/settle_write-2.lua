-- KEYS: version, the scope's counter. ARGV: owner, wrote (0/1), ttl (ms). The number
-- after it, or nil if the owner's mark is not there (settled already).
--- @include "version"
local r = redis.call('HMGET', KEYS[1], 'n', 'w', 'p')
if r[3] ~= ARGV[1] then return nil end
if ARGV[2] == '1' then
  r = {draw(), '1'}
end
return keep(r[1], r[2], '', ARGV[3])[1]
