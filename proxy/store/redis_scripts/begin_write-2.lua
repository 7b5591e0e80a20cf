-- KEYS: version, the scope's counter. ARGV: owner, ttl (ms). Returns {number, written,
-- 1} (writing: the owner's mark is there now): another owner's mark left unsettled gives
-- a fresh written number (it may have written).
--- @include "version"
local r = entry()
if r[3] ~= '' and r[3] ~= ARGV[1] then
  r = {draw(), '1'}
end
return keep(r[1], r[2], ARGV[1], ARGV[2])
