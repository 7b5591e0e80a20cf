-- The server's clock in whole milliseconds. Every script that writes includes it before
-- its first write, as it starts redis.replicate_commands() (a no-op on Redis 7, required
-- on 5 and 6 before writing after TIME); a script may read first, or end without it.
redis.replicate_commands()
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
