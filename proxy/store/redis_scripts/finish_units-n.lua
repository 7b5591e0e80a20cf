-- KEYS: rate buckets..., slot sets... ARGV: nrates, owner, then (interval ms, units) per rate.
--- @include "now_ms"
local nr, owner = tonumber(ARGV[1]), ARGV[2]
for i = 1, nr do
  local interval, units = tonumber(ARGV[1 + i * 2]), tonumber(ARGV[2 + i * 2])
  local tat = math.max(tonumber(redis.call('GET', KEYS[i]) or now), now) + interval * units
  if tat <= now then
    redis.call('DEL', KEYS[i])
  else
    redis.call('SET', KEYS[i], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1)
  end
end
for j = nr + 1, #KEYS do redis.call('ZREM', KEYS[j], owner) end
return 1
