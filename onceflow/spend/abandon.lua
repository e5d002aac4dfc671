-- A waiter gives up (timeout, cancel, the cascade moving on): it no longer counts as waiting.
-- KEYS: 1 waiters, 2 waiter_ws, 3 ws_waiting. ARGV: 1 permit id. Reply: 1 if it was waiting.
local ws = redis.call('HGET', KEYS[2], ARGV[1])
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and ws then
    if redis.call('HINCRBY', KEYS[3], ws, -1) <= 0 then redis.call('HDEL', KEYS[3], ws) end
end
redis.call('HDEL', KEYS[2], ARGV[1])
return ws and 1 or 0
