-- KEYS: pause, rate buckets..., slot sets... ARGV: nrates, nslots, owner, slot ttl (ms),
-- then (interval ms, tolerance ms, cost) per rate, then the capacity per slot set.
-- Returns {allowed, paused ms, retry ms, (remaining, reset ms, limited) per rate, then the
-- free slots per slot set}.
--- @include "now_ms"
local paused = tonumber(redis.call('GET', KEYS[1]) or 0)
if paused > now then return {0, math.ceil(paused - now), 0} end
local nr, ns, owner, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local out, tats, wait, full = {1, 0, 0}, {}, 0, false
for i = 1, nr do
  local a = 4 + (i - 1) * 3
  local interval, tolerance = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local cost = tonumber(ARGV[a + 3])
  local base = math.max(tonumber(redis.call('GET', KEYS[1 + i]) or now), now)
  local new = base + interval * cost
  local over = new - tolerance - now
  if over > 0.001 then
    wait = math.max(wait, over)
    table.insert(out, 0)
    table.insert(out, math.ceil(base - now))
    table.insert(out, 1)
  else
    tats[i] = new
    table.insert(out, math.max(math.floor((tolerance - (new - now)) / interval + 1e-6), 0))
    table.insert(out, math.ceil(new - now))
    table.insert(out, 0)
  end
end
for j = 1, ns do
  local key = KEYS[1 + nr + j]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local held = redis.call('ZCARD', key)
  local mine = redis.call('ZSCORE', key, owner)
  local left = tonumber(ARGV[4 + nr * 3 + j]) - held
  if not mine then left = left - 1 end
  if left < 0 then full = true end
  table.insert(out, left)
end
if wait > 0 or full then
  out[1] = 0
  out[3] = math.ceil(wait)
  return out
end
for i = 1, nr do
  redis.call('SET', KEYS[1 + i], string.format('%.3f', tats[i]), 'PX', math.ceil(tats[i] - now) + 1)
end
for j = 1, ns do
  local key = KEYS[1 + nr + j]
  redis.call('ZADD', key, now + ttl, owner)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, math.ceil(ttl)) end
end
return out
