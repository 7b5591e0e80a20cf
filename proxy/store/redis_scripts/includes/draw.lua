-- A scope's counter of fencing tokens and versions (KEYS[2]), started where the last
-- argument says (``locks.counter_start``: the clock in microseconds) when it is absent
-- (new, or lost with its Redis): a token or version never repeats one given before.
local function draw()
  if redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('SET', KEYS[2], ARGV[#ARGV])
  end
  return redis.call('INCR', KEYS[2])
end
