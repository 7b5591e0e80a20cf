-- KEYS: job, its route's stream. ARGV: worker, visibility (ms). 1 if the worker held it
-- (renewed: the hold's end in the job, the entry's idle time in the group).
--- @include "now"
--- @include "queue"
local r = redis.call('HMGET', KEYS[1], 'st', 'ho', 'hu', 'en')
if not (r[1] == 'queued' or r[1] == 'running') or r[2] ~= ARGV[1] then return 0 end
if tonumber(r[3]) <= now then return 0 end
redis.call('HSET', KEYS[1], 'hu', now + ARGV[2])
if r[4] ~= '' then
  redis.call('XCLAIM', KEYS[2], GROUP, ARGV[1], 0, r[4], 'JUSTID')
end
return 1
