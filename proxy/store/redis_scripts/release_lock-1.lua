-- KEYS: lock. ARGV: owner. 1 if the owner held it (now deleted).
if redis.call('HGET', KEYS[1], 'ow') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
