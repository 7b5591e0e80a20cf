-- KEYS: record. The record (see read).
--- @include "now"
--- @include "read"
return read(KEYS[1], now)
