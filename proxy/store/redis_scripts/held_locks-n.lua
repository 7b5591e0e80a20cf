-- KEYS: lock keys of one scope, read only. Returns per key {fencing token, ms left}
-- ({'', -2} for a lock freed since it was found).
local out = {}
for _, key in ipairs(KEYS) do
  table.insert(out, {redis.call('HGET', key, 'tk') or '', redis.call('PTTL', key)})
end
return out
