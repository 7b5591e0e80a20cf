-- KEYS: job, the route's stream, its due set. ARGV: id. A retry now due goes into the
-- stream (if the job is still QUEUED) and leaves the due set.
--- @include "now"
--- @include "queue"
local due = redis.call('ZSCORE', KEYS[3], ARGV[1])
if not due or tonumber(due) > now then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('HGET', KEYS[1], 'st') == 'queued' then
  redis.call('HSET', KEYS[1], 'en', enqueue(KEYS[2], ARGV[1]))
end
return 1
