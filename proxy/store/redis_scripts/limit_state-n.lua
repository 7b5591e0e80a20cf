-- KEYS: keys of one group (its pauses, rate buckets, slot sets), read only. ARGV: the kind
-- of each key ('s' a slot set, else a pause or a bucket: a time). Returns per key
-- {ms ahead of now, leases held}: a pause's end or a bucket's tat, or a slot set's
-- longest lease; {0, 0} for a key gone since it was found.
--- @include "now_ms"
local out, i = {}, 0
for _, key in ipairs(KEYS) do
  i = i + 1
  if ARGV[i] == 's' then
    local held = redis.call('ZCOUNT', key, '(' .. now, '+inf')
    local top = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
    local left = top[2] and tonumber(top[2]) - now or 0
    table.insert(out, {math.floor(math.max(left, 0)), held})
  else
    local until_ = tonumber(redis.call('GET', key) or 0)
    table.insert(out, {math.floor(math.max(until_ - now, 0)), 0})
  end
end
return out
