-- KEYS: a short lock. ARGV: owner. Deleted if the owner holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
