-- KEYS: job, its events, its route's stream, due set, expiry index. ARGV: expected
-- states (",queued,running,"), state, worker ('' for any), due (ms from now), token,
-- channel, then the fields to set (name, value, ...). The job, or nil.
--- @include "now"
--- @include "queue"
local r = redis.call('HMGET', KEYS[1], 'st', 'ho', 'hu', 'en', 'rt', 'id', 'sq', 'tk')
if r[8] == ARGV[5] then return redis.call('HMGET', KEYS[1], unpack(FIELDS)) end
if not r[1] or not string.find(ARGV[1], ',' .. r[1] .. ',', 1, true) then return false end
if ARGV[3] ~= '' and (r[2] ~= ARGV[3] or tonumber(r[3]) <= now) then return false end
local state, set = ARGV[2], {'st', ARGV[2], 'ut', now, 'sq', r[7] + 1, 'tk', ARGV[5]}
for i = 7, #ARGV do table.insert(set, ARGV[i]) end
if state == 'completed' or state == 'failed' or state == 'cancelled' then
  table.insert(set, 'rq') -- spent: the request (credentials and all) is dropped
  table.insert(set, '')
end
if state ~= 'running' then
  unqueue(KEYS[3], KEYS[4], r[6], r[4])
  local entry, due = '', now + tonumber(ARGV[4])
  if state == 'queued' then
    if due > now then
      redis.call('ZADD', KEYS[4], due, r[6])
    else
      entry = enqueue(KEYS[3], r[6])
    end
    table.insert(set, 'du')
    table.insert(set, due)
  end
  for _, v in ipairs({'ho', '', 'hu', 0, 'en', entry}) do table.insert(set, v) end
end
redis.call('HSET', KEYS[1], unpack(set))
return changed(KEYS[1], KEYS[2], KEYS[5], ARGV[6], r[6])
