-- The first half of a take. KEYS: the route's stream, its due set, the take's token key.
-- ARGV: worker, visibility (ms), XAUTOCLAIM cursor ('' to read new entries first). Hands
-- nothing out: {'took', '', id} (this take, sent again, handed it out already: hand_job
-- answers as then), {'due', ids} (retries now due, for requeue_job), {'new', entry, id}
-- (read for the worker, XREADGROUP), {'old', entry, id, cursor} (an entry idle for the
-- visibility, XAUTOCLAIM), or {'none'}. hand_job decides on the job itself.
--- @include "now"
--- @include "queue"
local took = redis.call('GET', KEYS[3])
if took then return {'took', '', took} end
local due = redis.call('ZRANGE', KEYS[2], '-inf', now, 'BYSCORE', 'LIMIT', 0, 100)
if #due > 0 then return {'due', due} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {'none'} end
if ARGV[3] == '' then
  local got = redis.call('XREADGROUP', 'GROUP', GROUP, ARGV[1], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
  if got then
    local entry = got[1][2][1]
    return {'new', entry[1], entry[2][2]}
  end
end
local cursor = ARGV[3] == '' and '0-0' or ARGV[3]
for _ = 1, 100 do
  local got = redis.call('XAUTOCLAIM', KEYS[1], GROUP, ARGV[1], ARGV[2], cursor, 'COUNT', 1)
  cursor = got[1]
  local entry = got[2][1]
  if entry then return {'old', entry[1], entry[2][2], cursor} end
  if cursor == '0-0' then break end
end
return {'none'}
