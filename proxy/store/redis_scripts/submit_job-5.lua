-- KEYS: job, its events, the route's stream, the id index, the expiry index. ARGV: id,
-- route, principal, slot, name, label, request, keep (ms), token, channel. Drops a few
-- expired jobs from the indexes on the way: each job is submitted once, so the indexes
-- hold about the live jobs.
--- @include "now"
--- @include "queue"
local tk = redis.call('HGET', KEYS[1], 'tk')
if tk then return tk == ARGV[9] and redis.call('HMGET', KEYS[1], unpack(FIELDS)) end
local gone = redis.call('ZRANGE', KEYS[5], '-inf', now, 'BYSCORE', 'LIMIT', 0, 16)
if #gone > 0 then
  redis.call('ZREM', KEYS[4], unpack(gone))
  redis.call('ZREM', KEYS[5], unpack(gone))
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'rt', ARGV[2], 'pr', ARGV[3], 'sl', ARGV[4],
  'nm', ARGV[5], 'lb', ARGV[6], 'rq', ARGV[7], 'kp', ARGV[8], 'st', 'queued', 'at', 0,
  'sn', 0, 'er', '', 'ct', now, 'ut', now, 'du', now, 'sq', 1, 'ho', '', 'hu', 0,
  'en', enqueue(KEYS[3], ARGV[1]), 'tk', ARGV[9])
redis.call('ZADD', KEYS[4], 0, ARGV[1])
return changed(KEYS[1], KEYS[2], KEYS[5], ARGV[10], ARGV[1])
