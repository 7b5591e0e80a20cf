-- KEYS: record, scope index. ARGV: owner, index member.
local r = redis.call('HMGET', KEYS[1], 'st', 'ow', 'pl')
if r[2] ~= ARGV[1] then return 0 end
if r[1] == 'in_progress' or (r[1] == 'failed' and r[3] == '') then
  redis.call('ZREM', KEYS[2], ARGV[2])
  return redis.call('DEL', KEYS[1])
end
return 0
