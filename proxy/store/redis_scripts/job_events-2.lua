-- KEYS: job, its events. ARGV: after (seq). {the job's fixed fields, events} or nil.
local job = redis.call('HMGET', KEYS[1], 'id', 'rt', 'pr', 'sl', 'nm', 'lb', 'kp', 'ct')
if not job[1] then return false end
return {job, redis.call('XRANGE', KEYS[2], '(0-' .. ARGV[1], '+')}
