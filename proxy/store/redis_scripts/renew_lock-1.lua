-- KEYS: lock. ARGV: owner, ttl (ms). 1 if the owner held it (now extended).
if redis.call('HGET', KEYS[1], 'ow') == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
