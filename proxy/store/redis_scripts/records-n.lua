-- One page of a scope's listing. KEYS: the scope index, then the page's records. ARGV:
-- 1 to drop from the index the members whose record is gone (0: a legacy set index),
-- then the page's members. Returns the records found, each with its member appended.
--- @include "now"
--- @include "read"
local out = {}
for i = 2, #KEYS do
  local found = read(KEYS[i], now)
  if found[1] == 1 then
    table.insert(found, ARGV[i])
    table.insert(out, found)
  elseif ARGV[1] == '1' then
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return out
