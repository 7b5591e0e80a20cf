-- A version is a hash: n (number), w (1: set by a write), p (the owner of a write sent
-- and not settled, or ''). KEYS[1] is the version, KEYS[2] the scope's counter. ``entry``
-- reads it, or makes a fresh unwritten one; ``keep`` stores it and answers {number,
-- written, writing} (writing 1: a write's mark is there).
--- @include "draw"
local function entry()
  local r = redis.call('HMGET', KEYS[1], 'n', 'w', 'p')
  if r[1] then return r end
  return {draw(), '0', ''}
end
local function keep(n, w, p, ttl)
  redis.call('HSET', KEYS[1], 'n', n, 'w', w, 'p', p)
  redis.call('PEXPIRE', KEYS[1], ttl)
  if p ~= '' then return {tonumber(n), tonumber(w), 1} end
  return {tonumber(n), tonumber(w), 0}
end
