-- The provider answered 429: every client waits `ms` (Redis clock) before its next call.
-- A longer cooling already set is kept.
-- KEYS: 1 cool, 2 stats. ARGV: 1 ms, 2 keep ms (see acquire.lua). Reply: the cooling left, in ms.
local ms = tonumber(ARGV[1])
local left = redis.call('PTTL', KEYS[1])
if left < ms then
    redis.call('SET', KEYS[1], '1', 'PX', ms)
    left = ms
end
redis.call('HINCRBY', KEYS[2], 'cooled', 1)
redis.call('PEXPIRE', KEYS[2], math.max(tonumber(ARGV[2]), left))
return left
