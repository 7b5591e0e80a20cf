-- A whole number of milliseconds as a string: Redis 7.0 turns a Lua number given to
-- redis.call into text with printf's %.17g, and that formatting took a twentieth of a
-- claim and its complete (docs/benchmarks.md); %d costs a fraction of it.
local function ms(n) return string.format('%d', n) end
