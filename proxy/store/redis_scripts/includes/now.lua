-- The server's clock in whole milliseconds. Every script that writes starts with
-- redis.replicate_commands() (a no-op on Redis 7, required on 5 and 6 before writing
-- after TIME).
redis.replicate_commands()
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
