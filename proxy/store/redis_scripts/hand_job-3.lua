-- The second half of a take. KEYS: job, the route's stream, the take's token key. ARGV:
-- entry ('' for the job this take handed out), id, worker, visibility (ms), new (1: read
-- by XREADGROUP), token. {1, job} if handed to the worker (held for the visibility), {0}
-- if not: an entry whose job ended, expired or was queued again under another entry is
-- dropped; a job held for longer than this visibility is left.
--- @include "now"
--- @include "queue"
local r = redis.call('HMGET', KEYS[1], 'st', 'en', 'hu', 'ho')
if redis.call('GET', KEYS[3]) == ARGV[2] and r[4] == ARGV[3] then
  return {1, redis.call('HMGET', KEYS[1], unpack(FIELDS))}
end
if ARGV[1] == '' then return {0} end -- handed out by this take, and held no more
if r[2] ~= ARGV[1] or not (r[1] == 'queued' or (r[1] == 'running' and ARGV[5] == '0')) then
  redis.call('XACK', KEYS[2], GROUP, ARGV[1])
  redis.call('XDEL', KEYS[2], ARGV[1])
  return {0}
end
if tonumber(r[3]) > now then return {0} end
redis.call('HSET', KEYS[1], 'ho', ARGV[3], 'hu', now + ARGV[4])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[4])
return {1, redis.call('HMGET', KEYS[1], unpack(FIELDS))}
