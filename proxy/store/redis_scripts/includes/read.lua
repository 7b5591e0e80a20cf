-- A record as {1, state, fingerprint, owner, payload, ms left, created, updated, replays}
-- or {0}.
local function read(key, now)
  local r = redis.call('HMGET', key, 'st', 'fp', 'ow', 'pl', 'lu', 'ct', 'ut', 'rp')
  if not r[1] then return {0} end
  local left = redis.call('PTTL', key)
  if r[1] == 'in_progress' then left = tonumber(r[5] or 0) - now end
  return {1, r[1], r[2], r[3], r[4] or '', left, r[6], r[7], r[8] or 0}
end
