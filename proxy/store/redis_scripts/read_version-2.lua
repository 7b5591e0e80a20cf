-- KEYS: version, the scope's counter. ARGV: ttl (ms). Returns {number, written}.
--- @include "version"
local r = entry()
return keep(r[1], r[2], r[3], ARGV[1])
