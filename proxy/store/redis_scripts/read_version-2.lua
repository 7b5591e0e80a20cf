-- KEYS: version, the scope's counter. ARGV: ttl (ms). Returns {number, written,
-- writing} (writing 1: a write's mark is there, unsettled).
--- @include "version"
local r = entry()
return keep(r[1], r[2], r[3], ARGV[1])
