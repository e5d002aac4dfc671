-- Take a compute lock and keep beside it the trace context of the holder's compute span,
-- so that a waiter's span can link to it (used only while tracing is on; otherwise the
-- acquire is a plain SET NX PX). The holder key lives as long as the lock: extend.lua
-- extends it, release.lua deletes it.
-- KEYS[1] = lock key, KEYS[2] = its holder key (same hash slot), ARGV[1] = owner token,
-- ARGV[2] = TTL in milliseconds, ARGV[3] = the holder span's W3C traceparent text.
-- Returns 1 when this owner holds the lock (taken now, or by an earlier send of this very
-- call whose reply was lost), 0 when someone else holds it.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
    return 1
end
-- pcall: a value of another type there (WRONGTYPE) is nobody's lock
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
    return 1
end
return 0
