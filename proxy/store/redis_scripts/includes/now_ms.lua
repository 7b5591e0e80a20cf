-- The server's clock in milliseconds, with their fraction (the rate buckets' GCRA).
redis.replicate_commands()
local t = redis.call('TIME')
local now = t[1] * 1000 + t[2] / 1000
