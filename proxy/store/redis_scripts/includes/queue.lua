-- The job queue (``RedisQueue``): times are milliseconds (Redis TIME). A job's keys and
-- its route's queue share one hash tag, so each script touches one slot.
local GROUP = 'workers'
local FIELDS = {'id', 'rt', 'pr', 'sl', 'nm', 'lb', 'rq', 'kp',
  'st', 'at', 'sn', 'er', 'ct', 'ut', 'du', 'sq'}
local function enqueue(stream, id)
  if redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, GROUP, '0', 'MKSTREAM')
  end
  return redis.call('XADD', stream, '*', 'id', id)
end
local function unqueue(stream, due, id, entry)
  if entry ~= '' then
    redis.call('XACK', stream, GROUP, entry)
    redis.call('XDEL', stream, entry)
  end
  redis.call('ZREM', due, id)
end
-- Keeps the job's snapshot as the event 0-<seq> of its event stream, restarts both keys'
-- expiry, indexes the job's expiry and tells subscribers (a channel is not a key).
local function changed(job, events, exp, channel, id)
  local r = redis.call('HMGET', job, 'sq', 'kp', 'st', 'at', 'sn', 'er', 'ut', 'du')
  redis.call('XADD', events, '0-' .. r[1], 'st', r[3], 'at', r[4], 'sn', r[5], 'er', r[6],
    'ut', r[7], 'du', r[8])
  redis.call('PEXPIRE', job, r[2])
  redis.call('PEXPIRE', events, r[2])
  redis.call('ZADD', exp, now + r[2], id)
  redis.call('PUBLISH', channel, id)
  return redis.call('HMGET', job, unpack(FIELDS))
end
