-- KEYS: record, scope index. ARGV: owner, state, payload, result_ms, fingerprint, member,
-- replace_outcome (0/1), the owner from now on. The record's score in the index (ix) is
-- moved only if the record now outlives it (its lease lapsed first), or if it would
-- outlive the record by more than result_ms (a job's long queued lease): the index then
-- holds a finished record at most result_ms past its end.
--- @include "now"
--- @include "ms"
local r = redis.call('HMGET', KEYS[1], 'ow', 'ct', 'st', 'ix')
if r[1] and r[1] ~= ARGV[1] then return 0 end
if ARGV[7] == '0' and r[3] and r[3] ~= 'in_progress' and
  (r[3] ~= 'failed' or redis.call('HSTRLEN', KEYS[1], 'pl') > 0) then return 0 end
local at, ends, scored = ms(now), now + ARGV[4], tonumber(r[4] or 0)
local moved = ends > scored or scored - ends > tonumber(ARGV[4])
local ix = moved and ms(ends) or r[4]
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'pl', ARGV[3], 'fp', ARGV[5], 'ow', ARGV[8],
  'ct', r[2] or at, 'ut', at, 'ix', ix)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if moved then
  redis.call('ZADD', KEYS[2], ix, ARGV[6])
  if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
end
return 1
